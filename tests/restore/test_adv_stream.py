"""Adversarial checks of the in-place restore pipeline (restore/stream.py), found by adv.

A copier thread that fails mid-swap must fail the load and leave every byte of the caller's
tensors as it was (its exception was dropped by the executor: the load reported success
with some windows never copied in)."""

import pytest
import torch

import zerostall
from zerostall.config import IOConfig
from zerostall.io.base import get_engine
from zerostall.restore import LoadRequest
from zerostall.restore import load as restore_load
from zerostall.restore import stream
from zerostall.memory.arena import Arena
from tests.helpers import clone, equal

pytestmark = pytest.mark.timeout(300)
SMALL_IO = dict(chunk_bytes=64 << 10, queue_depth=4)  # 128 KiB windows: many windows


def _state(v: float) -> dict:
    g = torch.Generator().manual_seed(int(v * 10))
    return {"model": {f"t{i}": torch.randn(1000 + 37 * i, generator=g) + v for i in range(40)},
            "big": torch.randn(300_000, generator=g) * v, "step": int(v)}


def _load(root, sd, **kw):
    eng = get_engine("threads", IOConfig(engine="threads", **SMALL_IO))
    try:
        return restore_load(root, sd, LoadRequest(**kw), engine=eng, bounce=Arena(32 << 20, mlock=False))
    finally:
        eng.close()


@pytest.mark.parametrize("fail_at", [1, 5])
def test_a_copier_that_fails_mid_swap_fails_the_load_and_rolls_back(tmp_path, monkeypatch, fail_at):
    monkeypatch.setattr(stream, "ROLLBACK_FRACTION", 1.0)
    monkeypatch.setattr(stream, "ADAPTIVE", False)  # every window swapped by the copiers
    root = str(tmp_path / "ck")
    zerostall.save(root, _state(2.0), step=2)
    calls = []
    real = stream.swap

    def swap(dst, src, n, swapped):
        calls.append(n)
        if len(calls) == fail_at:
            raise MemoryError("injected: a copier failed")
        real(dst, src, n, swapped)

    monkeypatch.setattr(stream, "swap", swap)
    sd = clone(_state(1.0))
    before = clone(sd)
    with pytest.raises(Exception):
        _load(root, sd, step=2, fallback=False)
    assert len(calls) >= fail_at
    assert equal(sd, before)  # every byte, including windows swapped in before the failure
    monkeypatch.setattr(stream, "swap", real)
    _load(root, sd, step=2, fallback=False)
    assert equal(sd, _state(2.0))


def test_a_shard_replaced_between_verify_first_and_copy_is_refused_before_any_copy(tmp_path, monkeypatch):
    """A step larger than the scratch is read twice (verify, then copy into the caller's
    tensors). A shard replaced in between (a new file renamed over it, a byte different in its
    last tensor) was copied item by item until that tensor's crc32c failed: the caller's
    tensors held the step's bytes and a torn tensor. The copy pass now checks that it reads
    the file the verify pass verified."""
    import os
    import shutil

    from zerostall.errors import CorruptCheckpoint
    from zerostall.store.local import LocalTier
    from tests.helpers import flip_byte

    root = str(tmp_path / "ck")
    zerostall.save(root, _state(2.0), step=2)
    man = LocalTier(root).read_manifest(2)
    last = max(man.tensors, key=lambda e: e.offset)
    shard = os.path.join(root, "step-2", last.file)
    from zerostall.restore import step as rstep
    real, runs = rstep.read_later, []

    def read_later(*a, **kw):
        runs.append(1)  # the verify pass is done: a different file takes the shard's name
        shutil.copyfile(shard, shard + ".new")
        flip_byte(shard + ".new", last.offset + last.nbytes - 1)
        os.replace(shard + ".new", shard)
        return real(*a, **kw)

    monkeypatch.setattr(rstep, "read_later", read_later)
    sd = clone(_state(1.0))
    before = clone(sd)
    eng = get_engine("threads", IOConfig(engine="threads", **SMALL_IO))
    try:
        with pytest.raises(CorruptCheckpoint):
            restore_load(root, sd, LoadRequest(step=2, fallback=False), engine=eng, bounce=Arena(1 << 20, mlock=False))
    finally:
        eng.close()
    assert runs and equal(sd, before)


def test_one_tensor_at_two_keys_the_step_holds_apart_is_not_written_by_two_copiers(tmp_path, monkeypatch):
    """A caller's tensor at two keys (tied weights) that the checkpoint holds as two tensors
    was filled in place by both items: two copier threads swapping into the same bytes at once
    (seen: 1 load in 4 left a mix of both tensors' values, 64 MiB each, no error; a failed load
    could roll back to either). Both now come through new tensors and merge() copies them in
    key order: the last key wins, as in load_state_dict; an untied tensor stays in place."""
    from zerostall.restore import step as rstep

    root = str(tmp_path / "ck")
    n = 300_000
    zerostall.save(root, {"a": torch.full((n,), 1.0), "b": torch.full((n,), 2.0), "c": torch.full((n,), 3.0)}, step=1)
    seen = []
    real = rstep.read_step

    def spy(files, *a, **kw):
        seen.append([(fr.items[i].key for i in fr.protect) for fr in files])
        seen[-1] = sorted(k for g in seen[-1] for k in g)
        return real(files, *a, **kw)

    monkeypatch.setattr(rstep, "read_step", spy)
    w, c = torch.zeros(n), torch.zeros(n)
    zerostall.load(root, {"a": w, "b": w, "c": c})
    assert seen == [["c"]]  # only the untied tensor was filled in place
    assert torch.equal(w, torch.full((n,), 2.0)) and torch.equal(c, torch.full((n,), 3.0))
    v = torch.zeros(2 * n)  # partly overlapping views count too
    zerostall.load(root, {"a": v[:n], "b": v[n // 2:n // 2 + n], "c": c})
    assert seen[-1] == ["c"] and torch.equal(v[n // 2:n // 2 + n], torch.full((n,), 2.0))
    assert torch.equal(v[:n // 2], torch.full((n // 2,), 1.0))


@pytest.mark.skipif(__import__("os").environ.get("ZEROSTALL_TEST_S3") != "1",
                    reason="no S3 server: source the environment of scripts/s3-server.sh")
def test_a_remote_object_replaced_between_verify_first_and_copy_is_refused(tmp_path, monkeypatch):
    """The same for a step streamed from S3 (``download=False``) that neither the scratch nor
    half the host's free memory holds: the copy pass reads the object version (ETag) that the
    verify pass verified, or nothing."""
    import os
    import uuid

    from zerostall.errors import CorruptCheckpoint
    from zerostall.restore import step as rstep
    from zerostall.store.tier import open_tier

    url = f"s3://zerostall-remote-test/adv-{uuid.uuid4().hex[:10]}"
    tier = open_tier(url, attempts=1, read_timeout_s=10)
    try:
        with zerostall.Checkpointer(str(tmp_path / "w"), remote=url) as ck:
            assert ck.save(2, _state(2.0)).wait(timeout=120, tier="remote")
        man = tier.read_manifest(2)
        last = max(man.tensors, key=lambda e: e.offset)
        key = tier._key(f"step-2/{last.file}")
        monkeypatch.setattr(rstep, "_meminfo", lambda *k: 0)  # no transient scratch: verify first
        real, runs = rstep.read_later, []

        def read_later(*a, **kw):
            runs.append(1)  # verified: a changed object is uploaded under the same name
            raw = bytearray(tier.client.get_object(Bucket=tier.bucket, Key=key)["Body"].read())
            raw[last.offset + last.nbytes - 1] ^= 0x40
            tier.client.put_object(Bucket=tier.bucket, Key=key, Body=bytes(raw))
            return real(*a, **kw)

        monkeypatch.setattr(rstep, "read_later", read_later)
        sd = clone(_state(1.0))
        before = clone(sd)
        empty = str(tmp_path / "empty")
        os.makedirs(empty)
        with pytest.raises(CorruptCheckpoint):
            restore_load(empty, sd, LoadRequest(step=2, remote=url, download=False, fallback=False),
                         bounce=Arena(1 << 20, mlock=False))
        assert runs and equal(sd, before)
    finally:
        tier._delete_prefix("")
