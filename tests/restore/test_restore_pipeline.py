"""The restore read pipeline (restore/stream.py) at many shapes, both engines, real O_DIRECT files.

In place (rollback part, staged part, both, and the verify-first fallback), new dict (read
straight into page-aligned tensors, or through the ring), keys=, corruption and read errors
anywhere leaving the caller's tensors exactly as they were, 100k tiny tensors. Windows are
made small (64 KiB requests) so every shape crosses many windows and ring laps.
"""

import os

import pytest
import torch

import zerostall
from zerostall.config import IOConfig
from zerostall.errors import CorruptCheckpoint, StorageError
from zerostall.io.base import get_engine
from zerostall.io.threads import ThreadsEngine, _ThreadsFile
from zerostall.restore import LoadRequest
from zerostall.restore import load as restore_load
from zerostall.restore import step as rstep
from zerostall.restore import stream
from zerostall.memory.arena import Arena
from zerostall.store.local import LocalTier
from tests.helpers import clone, equal, flip_byte, skip_unless_engine

pytestmark = pytest.mark.timeout(300)
SMALL_IO = dict(chunk_bytes=64 << 10, queue_depth=4)  # 128 KiB windows


def _state(v: float) -> dict:
    g = torch.Generator().manual_seed(int(v * 10))
    return {"model": {"emb": torch.randn(300, 129, generator=g) + v,  # 154,800 B: not a multiple of 4 KiB
                      "w": torch.randn(512, 256, generator=g) + v,
                      "b": torch.full((3,), v), "half": (torch.randn(1000, generator=g) + v).to(torch.bfloat16),
                      "mask": torch.arange(5001) % 3 == int(v) % 3, "i8": torch.arange(-50, 77, dtype=torch.int8)},
            "optim": {"m": torch.randn(200_000, generator=g) * v, "s": torch.tensor(v), "empty": torch.empty(0)},
            "step": int(v)}


def _dest(v: float = -7.0) -> dict:
    d = clone(_state(1.0))
    for part in ("model", "optim"):
        for t in d[part].values():
            if t.numel():
                t.copy_(torch.full_like(t, v) if t.dtype != torch.bool else torch.ones_like(t))
    return d


def _load(root, engine, sd=None, **kw):
    eng = get_engine(engine, IOConfig(engine=engine, **SMALL_IO))
    bounce = kw.pop("bounce", None) or Arena(32 << 20, mlock=False)
    report = kw.pop("report", None)
    try:
        return restore_load(root, sd, LoadRequest(**kw), engine=eng, bounce=bounce, report=report)
    finally:
        eng.close()


def _flip_tensor(root, step, key, at=1):
    man = LocalTier(root).read_manifest(step)
    e = next(t for t in man.tensors if t.key == key)
    flip_byte(os.path.join(root, f"step-{step}", e.file), e.offset + at)


@pytest.fixture(params=["uring", "threads"])
def engine(request):
    skip_unless_engine(request.param)
    return request.param


@pytest.mark.parametrize("fraction", [0.0, 0.5, 1.0])
def test_in_place_every_layout_is_bit_exact(tmp_path, engine, fraction, monkeypatch):
    monkeypatch.setattr(stream, "ROLLBACK_FRACTION", fraction)
    monkeypatch.setattr(stream, "ADAPTIVE", False)  # the split exactly as planned
    root = str(tmp_path / "ck")
    zerostall.save(root, _state(2.0), step=2)
    sd = _dest()
    ptrs = {k: t.data_ptr() for k, t in sd["model"].items()}
    _load(root, engine, sd)
    assert equal(sd, _state(2.0))
    assert {k: t.data_ptr() for k, t in sd["model"].items()} == ptrs  # filled in place
    st = rstep.last_stats
    assert st.windows > 10
    if fraction == 0.0:
        assert st.rollback_bytes == 0 and st.deferred_bytes > 0
    elif fraction == 0.5:
        assert st.rollback_bytes > 0 and st.deferred_bytes > 0
    else:  # every copy swapped in under rollback, none staged
        assert st.rollback_bytes > 0 and st.deferred_bytes == 0


def test_in_place_adaptive_swaps_as_the_copiers_keep_up(tmp_path, engine):
    """The default: every window may be swapped in while reading; the swaps not started when
    every byte verified are staged copies instead. Every byte lands once, either way."""
    root = str(tmp_path / "ck")
    zerostall.save(root, _state(2.0), step=2)
    sd = _dest()
    _load(root, engine, sd)
    st = rstep.last_stats
    assert equal(sd, _state(2.0))
    payload = sum(t.numel() * t.element_size() for part in ("model", "optim") for t in sd[part].values())
    assert st.rollback_bytes + st.deferred_bytes == payload


@pytest.mark.parametrize("fraction", [0.0, 0.5, 0.95])
@pytest.mark.parametrize("key", ["model.emb", "optim.m", "optim.s"])
def test_corruption_anywhere_leaves_the_callers_tensors_untouched(tmp_path, engine, fraction, key, monkeypatch):
    """The step fails at its first, middle or last tensor, after rollback copies were made
    (fraction > 0) or while everything was staged: not one byte of it stays in the caller's tensors."""
    monkeypatch.setattr(stream, "ROLLBACK_FRACTION", fraction)
    monkeypatch.setattr(stream, "ADAPTIVE", fraction != 0.95)  # 0.95: every planned swap made
    root = str(tmp_path / "ck")
    zerostall.save(root, _state(1.0), step=1)
    zerostall.save(root, _state(2.0), step=2)
    _flip_tensor(root, 2, key)
    sd, before = _dest(), _dest()
    with pytest.raises(CorruptCheckpoint, match=key.replace(".", r"\.")):
        _load(root, engine, sd, step=2, fallback=False)
    assert equal(sd, before)
    rep = zerostall.LoadReport()
    _load(root, engine, sd, report=rep)  # falls back to step 1, transactionally
    assert rep.step == 1 and equal(sd, _state(1.0))


def test_read_error_mid_stream_rolls_back(tmp_path, monkeypatch):
    """An I/O error on a window read after rollback copies were made: StorageError, caller's
    tensors as they were."""
    monkeypatch.setattr(stream, "ROLLBACK_FRACTION", 0.5)
    root = str(tmp_path / "ck")
    zerostall.save(root, _state(2.0), step=2)
    reads = []

    class FailingReads(ThreadsEngine):
        def _wrap(self, path, fd, writable):
            class F(_ThreadsFile):
                def read(self, extents):
                    reads.append(extents[0][0])
                    if len(reads) == 12:
                        raise StorageError(f"injected read error in {path}")
                    super().read(extents)
            return F(self, path, fd, writable)

    eng = FailingReads(IOConfig(engine="threads", **SMALL_IO))
    sd, before = _dest(), _dest()
    try:
        with pytest.raises(CorruptCheckpoint, match="no checkpoint .* verifies"):
            restore_load(root, sd, engine=eng, bounce=Arena(32 << 20, mlock=False))
    finally:
        eng.close()
    assert len(reads) >= 12 and equal(sd, before)


def test_verify_first_when_the_step_does_not_fit_the_scratch(tmp_path, engine, caplog):
    root = str(tmp_path / "ck")
    zerostall.save(root, _state(1.0), step=1)
    zerostall.save(root, _state(2.0), step=2)
    _flip_tensor(root, 2, "optim.s")
    sd = _dest()
    with caplog.at_level("INFO", logger="zerostall"):
        _load(root, engine, sd, bounce=Arena(1 << 20, mlock=False))  # smaller than one step
    assert "verifying it first" in caplog.text and equal(sd, _state(1.0))


@pytest.mark.parametrize("direct_min", [1 << 30, 64 << 10, 1])
def test_new_dict_direct_and_ring(tmp_path, engine, direct_min, monkeypatch):
    monkeypatch.setattr(stream, "DIRECT_MIN_BYTES", direct_min)
    root = str(tmp_path / "ck")
    zerostall.save(root, _state(3.0), step=3)
    out = _load(root, engine)
    assert equal(out, _state(3.0))
    big = out["optim"]["m"]
    if direct_min <= big.numel() * 4:
        assert big.data_ptr() % 4096 == 0  # read into directly
    out["model"]["w"].add_(1)  # an ordinary, writable tensor
    assert not torch.equal(out["model"]["w"], _state(3.0)["model"]["w"])


def test_new_dict_direct_checks_the_padding_it_read_into(tmp_path, engine, monkeypatch):
    """A non-zero byte in the padding after a tensor read straight into its destination."""
    monkeypatch.setattr(stream, "DIRECT_MIN_BYTES", 1)
    root = str(tmp_path / "ck")
    zerostall.save(root, _state(3.0), step=3)
    man = LocalTier(root).read_manifest(3)
    e = next(t for t in man.tensors if t.key == "model.emb")
    flip_byte(os.path.join(root, "step-3", e.file), e.offset + e.nbytes + 10)
    with pytest.raises(CorruptCheckpoint, match="padding"):
        _load(root, engine, fallback=False)


def test_keys_read_only_their_ranges(tmp_path, engine):
    root = str(tmp_path / "ck")
    zerostall.save(root, _state(4.0), step=4)
    _flip_tensor(root, 4, "optim.m")  # never read by the keys= load below
    out = _load(root, engine, keys=["model.w", "optim.s"])
    assert torch.equal(out["model"]["w"], _state(4.0)["model"]["w"]) and out["optim"]["s"].item() == 4.0
    fe = LocalTier(root).read_manifest(4).files[0]
    assert rstep.last_stats.bytes_read < fe.file_bytes // 2
    sd = _dest()
    _load(root, engine, sd, keys=["model"])
    assert equal(sd["model"], _state(4.0)["model"]) and equal(sd["optim"], _dest()["optim"])


def test_verify_step_reads_every_byte(tmp_path, engine):
    root = str(tmp_path / "ck")
    zerostall.save(root, _state(5.0), step=5)
    tier = LocalTier(root)
    eng = get_engine(engine, IOConfig(engine=engine, **SMALL_IO))
    try:
        rstep.verify_step(tier, 5, eng, Arena(8 << 20, mlock=False))
        assert rstep.last_stats.bytes_read == tier.read_manifest(5).files[0].file_bytes
        man = tier.read_manifest(5)
        flip_byte(os.path.join(root, "step-5", man.files[0].name), man.files[0].file_bytes - 1)
        with pytest.raises(CorruptCheckpoint, match="padding"):
            rstep.verify_step(tier, 5, eng, Arena(8 << 20, mlock=False))
    finally:
        eng.close()


def test_100k_tiny_tensors(tmp_path):
    """A 100k-tensor state (per-parameter optimizer state of a large MoE) round-trips, in place
    and into a new dict, bit-exact."""
    n = 100_000
    state = {"p": {str(i): torch.full((1 + i % 3,), float(i)) for i in range(n)}}
    root = str(tmp_path / "ck")
    zerostall.save(root, state, step=1)
    out = zerostall.load(root)
    assert len(out["p"]) == n and equal(out, state)
    sd = {"p": {k: torch.zeros_like(t) for k, t in state["p"].items()}}
    ptr = sd["p"]["99999"].data_ptr()
    zerostall.load(root, sd)
    assert equal(sd, state) and sd["p"]["99999"].data_ptr() == ptr


def test_a_remote_tier_streams_through_the_same_pipeline(tmp_path, engine):
    """load_step and verify_tier_step on a shared-filesystem tier (file://): the shard is read
    through the tier's reader (several windows at once), nothing is written locally."""
    from zerostall.store.tier import open_tier
    root = str(tmp_path / "remote")
    zerostall.save(root, _state(6.0), step=6)
    before = sorted(os.listdir(root))
    tier = open_tier("file://" + root)
    eng = get_engine(engine, IOConfig(engine=engine, **SMALL_IO))
    try:
        assert equal(rstep.load_step(tier, 6, eng, Arena(8 << 20, mlock=False)), _state(6.0))
        sd = _dest()
        rstep.load_step(tier, 6, eng, Arena(8 << 20, mlock=False), sd)
        assert equal(sd, _state(6.0)) and rstep.last_stats.windows > 10
        assert rstep.verify_tier_step(tier, 6).step == 6
        _flip_tensor(root, 6, "model.w")
        with pytest.raises(CorruptCheckpoint, match=r"model\.w"):
            rstep.verify_tier_step(tier, 6)
    finally:
        eng.close()
    assert sorted(os.listdir(root)) == before


@pytest.mark.parametrize("fraction", [0.0, 0.5])
def test_a_gate_that_refuses_rolls_back(tmp_path, engine, fraction, monkeypatch):
    """The ranks' agreement (gate) runs once every byte verified; when it raises (another rank
    cannot load this step), the rollback copies already made are undone."""
    from zerostall.errors import DistributedError
    monkeypatch.setattr(stream, "ROLLBACK_FRACTION", fraction)
    root = str(tmp_path / "ck")
    zerostall.save(root, _state(2.0), step=2)
    calls = []

    def refuse():
        calls.append(1)
        raise DistributedError("rank 1 cannot load step 2")

    sd, before = _dest(), _dest()
    with pytest.raises(DistributedError):
        _load(root, engine, sd, gate=refuse)
    assert calls == [1] and equal(sd, before)
    _load(root, engine, sd, gate=lambda: calls.append(2))
    assert calls == [1, 2] and equal(sd, _state(2.0))


def test_a_remote_tier_too_big_for_the_scratch_is_read_once(tmp_path, engine, caplog):
    """In place from a remote tier (slower than faulting new memory) when the lent scratch is
    too small: a transient scratch, one read of the remote bytes, not a verify-first pass;
    a damaged object still leaves the caller's tensors as they were."""
    from zerostall.store.tier import open_tier
    root = str(tmp_path / "remote")
    zerostall.save(root, _state(6.0), step=6)
    tier = open_tier("file://" + root)
    eng = get_engine(engine, IOConfig(engine=engine, **SMALL_IO))
    try:
        sd = _dest()
        with caplog.at_level("INFO", logger="zerostall"):
            rstep.load_step(tier, 6, eng, Arena(1 << 20, mlock=False), sd)
        assert equal(sd, _state(6.0)) and "verifying it first" not in caplog.text
        assert rstep.last_stats.rollback_bytes + rstep.last_stats.deferred_bytes > 1 << 20
        _flip_tensor(root, 6, "optim.m")
        sd, before = _dest(), _dest()
        with pytest.raises(CorruptCheckpoint, match=r"optim\.m"):
            rstep.load_step(tier, 6, eng, Arena(1 << 20, mlock=False), sd)
        assert equal(sd, before)
    finally:
        eng.close()


def test_swaps_the_copiers_did_not_start_before_the_end_become_staged_copies(tmp_path, engine, monkeypatch):
    """The copiers held back (a seam: each copy job waits until every byte verified): every
    planned swap turns into a staged copy after the checks, bit-exact; and when the step fails,
    none of them touched the caller's tensors."""
    import time
    real = stream._Run._copies

    def late_copies(self, jobs, slot):
        while not self.closing:
            time.sleep(0.001)
        real(self, jobs, slot)

    monkeypatch.setattr(stream._Run, "_copies", late_copies)
    root = str(tmp_path / "ck")
    zerostall.save(root, _state(1.0), step=1)
    zerostall.save(root, _state(2.0), step=2)
    sd = _dest()
    _load(root, engine, sd, step=1)
    st = rstep.last_stats
    assert equal(sd, _state(1.0)) and st.rollback_bytes == 0 and st.deferred_bytes > 0
    _flip_tensor(root, 2, "optim.s")
    sd, before = _dest(), _dest()
    with pytest.raises(CorruptCheckpoint, match=r"optim\.s"):
        _load(root, engine, sd, step=2, fallback=False)
    assert equal(sd, before)
