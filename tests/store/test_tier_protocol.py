"""One suite every tier must pass (fsspec's abstract-test model): the local directory, the
shared-filesystem tier and S3 (the real radosgw), through the Tier protocol only."""

import dataclasses
import os
import uuid

import pytest
import torch

import zerostall
from zerostall.errors import CheckpointExistsError
from zerostall.format.manifest import MANIFEST_NAME, Manifest
from zerostall.restore import verify_tier_step
from zerostall.memory.arena import Arena
from zerostall.store import open_root
from zerostall.store.tier import Tier, open_tier

S3 = os.environ.get("ZEROSTALL_TEST_S3") == "1"


@pytest.fixture(params=["local", "file", "s3"])
def tier(request, tmp_path):
    if request.param == "local":
        t = open_root(str(tmp_path / "tier"), create=True)
    elif request.param == "file":
        t = open_tier(f"file://{tmp_path / 'shared'}")
    else:
        if not S3:
            if os.environ.get("CI"):
                pytest.fail("CI must start the S3 server (scripts/s3-server.sh start) before the tests")
            pytest.skip("no S3 server: run scripts/s3-server.sh start and export its environment")
        t = open_tier(f"s3://zerostall-remote-protocol/{uuid.uuid4().hex[:12]}")
    t.own()
    yield t
    for s in t.steps():
        t.delete(s)
    if request.param == "s3":  # uncommitted leftovers too: the test server keeps objects in memory
        t._delete_prefix("")
    t.release()


@pytest.fixture(scope="module")
def source(tmp_path_factory):
    """A real checkpoint (manifest + shard bytes) to copy through each tier."""
    d = str(tmp_path_factory.mktemp("src"))
    g = torch.Generator().manual_seed(0)
    zerostall.save(d, {"w": torch.randn(70_000, generator=g), "b": torch.arange(9), "n": 3}, step=7)
    man = open_root(d).read_manifest(7)
    files = {fe.name: open(os.path.join(d, "step-7", fe.name), "rb").read() for fe in man.files}
    return man, files


def _write(tier, step, man, files, commit=True):
    tier.begin(step)
    for fe in man.files:
        data = files[fe.name]
        buf = Arena(len(data), mlock=False)
        try:
            buf.mv[:len(data)] = data
            w = tier.open_shard_write(step, fe.name, len(data))
            try:
                half = len(data) // 2 // 4096 * 4096  # two extents, in file order
                w.write([(0, buf.mv[:half])])
                w.write([(half, buf.mv[half:len(data)])])
                w.finish()
            finally:
                w.close()
        finally:
            buf.close()
    return tier.commit(step, man) if commit else None


def _put_manifest_bytes(tier, step, data):
    tier.put_bytes(data, f"step-{step}/{MANIFEST_NAME}")


def test_write_list_read_verify_delete(tier, source):
    man, files = source
    assert isinstance(tier, Tier) and tier.steps() == [] and tier.latest() is None
    assert _write(tier, 7, man, files) == ()
    assert tier.steps() == [7] and tier.latest() == 7
    got = tier.read_manifest(7)
    assert got.checkpoint_id == man.checkpoint_id and got.tensors == man.tensors
    assert verify_tier_step(tier, 7).step == 7  # every byte, through open_shard_read
    with pytest.raises(CheckpointExistsError):
        _write(tier, 7, man, files)
    tier.abort(7)
    assert tier.steps() == [7]
    tier.delete(7)
    assert tier.steps() == []


def test_overwrite_keeps_the_old_step_whole_until_the_new_one_commits(tier, source, tmp_path):
    """Writing over a committed step: at every point before the commit, the step verifies as
    the old checkpoint (remote tiers used to write the new shards over the old objects that
    the old manifest names); after it, as the new one, with nothing else left in the step."""
    man, files = source
    _write(tier, 7, man, files)
    d = str(tmp_path / "other")
    zerostall.save(d, {"w": torch.zeros(70_000), "b": torch.arange(9) * 2, "n": 4}, step=7)
    new = open_root(d).read_manifest(7)
    new_files = {fe.name: open(os.path.join(d, "step-7", fe.name), "rb").read() for fe in new.files}
    assert set(new_files) == set(files)  # the same object names, other bytes
    _write(tier, 7, new, new_files, commit=False)
    assert tier.steps() == [7] and verify_tier_step(tier, 7).checkpoint_id == man.checkpoint_id
    assert tier.commit(7, new, overwrite=True) == ()
    assert verify_tier_step(tier, 7).checkpoint_id == new.checkpoint_id
    assert tier.names_in(7) == sorted(list(new_files) + [MANIFEST_NAME])


def test_only_steps_with_a_valid_manifest_count(tier, source):
    man, files = source
    _write(tier, 7, man, files, commit=False)  # data without a manifest: not a step
    assert tier.steps() == []
    tier.abort(7)
    _write(tier, 7, man, files)
    raw = man.to_bytes()
    _put_manifest_bytes(tier, 7, raw[:-10] + b"garbage!!!")  # a damaged manifest: not a step
    assert tier.steps() == []
    _put_manifest_bytes(tier, 7, raw)
    assert tier.steps() == [7]
    other = dataclasses.replace(man, step=8)  # a manifest in the wrong directory: not a step
    _write(tier, 8, other, files, commit=False)
    _put_manifest_bytes(tier, 8, Manifest.to_bytes(man))
    assert tier.steps() == [7]


def test_abort_never_touches_a_committed_step(tier, source):
    man, files = source
    _write(tier, 7, man, files)
    tier.abort(7)
    assert tier.steps() == [7] and verify_tier_step(tier, 7).step == 7


def test_an_oversized_manifest_is_not_a_step(tier, source, monkeypatch):
    """A manifest over the size limit is a damaged step on every tier (skipped by the listing,
    CorruptCheckpoint naming it when read), not an error that hides the tier's other steps."""
    from zerostall.errors import CorruptCheckpoint
    from zerostall.store import local, remote
    man, files = source
    _write(tier, 7, man, files)
    big = dataclasses.replace(man, step=8, files=tuple(dataclasses.replace(fe, host="h" * 255) for fe in man.files))
    _write(tier, 8, big, files)
    assert tier.steps() == [7, 8]
    for mod in (local, remote):
        monkeypatch.setattr(mod, "MAX_MANIFEST_BYTES", len(man.to_bytes()))
    tier._verdicts.clear()
    assert tier.steps() == [7] and tier.latest() == 7
    with pytest.raises(CorruptCheckpoint, match="over the"):
        tier.read_manifest(8)
