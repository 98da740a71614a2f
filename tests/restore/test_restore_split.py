"""The split read of an in-place load larger than its scratch (restore/step.read_step).

A fresh process has no faulted staging pool: the first ``HEAD_FRACTION`` of the step is read
once into new memory under rollback (swapped into the caller's tensors as it verifies), the
rest is verified first through the ring and read again once every byte passed. Real O_DIRECT
files, both engines; every failure leaves the caller's tensors exactly as they were,
including the head's bytes already swapped in.
"""

import os

import pytest
import torch

import zerostall
from zerostall.config import IOConfig
from zerostall.errors import CorruptCheckpoint, DistributedError
from zerostall.io.base import get_engine
from zerostall.restore import LoadRequest
from zerostall.restore import load as restore_load
from zerostall.restore import step as rstep
from zerostall.memory.arena import Arena
from zerostall.store.local import LocalTier
from tests.helpers import clone, equal, flip_byte, skip_unless_engine

pytestmark = pytest.mark.timeout(300)
SMALL_IO = dict(chunk_bytes=64 << 10, queue_depth=4)  # 128 KiB windows


def _state(v: float) -> dict:
    g = torch.Generator().manual_seed(int(v * 10))
    return {"a": {f"t{i}": torch.randn(40_000 + 999 * i, generator=g) + v for i in range(12)},
            "b": {"small": torch.full((7,), v), "big": torch.randn(300_000, generator=g) * v}}


def _load(root, engine, sd, **kw):
    eng = get_engine(engine, IOConfig(engine=engine, **SMALL_IO))
    try:  # 1 MiB of scratch: a ring of 256 KiB windows, far less than the ~3.5 MiB step
        return restore_load(root, sd, LoadRequest(fallback=False, **kw), engine=eng, bounce=Arena(1 << 20, mlock=False))
    finally:
        eng.close()


@pytest.fixture(params=["uring", "threads"])
def engine(request):
    skip_unless_engine(request.param)
    return request.param


@pytest.mark.parametrize("fraction", [0.0, 0.3, 0.5, 1.0])
def test_split_read_is_bit_exact_and_reads_only_the_tail_twice(tmp_path, engine, fraction, monkeypatch):
    monkeypatch.setattr(rstep, "HEAD_FRACTION", fraction)
    root = str(tmp_path / "ck")
    zerostall.save(root, _state(2.0), step=2)
    sd = clone(_state(1.0))
    ptrs = {k: t.data_ptr() for k, t in sd["a"].items()}
    _load(root, engine, sd)
    assert equal(sd, _state(2.0)) and {k: t.data_ptr() for k, t in sd["a"].items()} == ptrs
    file_bytes = LocalTier(root).read_manifest(2).files[0].file_bytes
    st = rstep.last_stats
    if fraction == 0.0:  # no new memory: every byte read twice (the tail is everything)
        assert st.rollback_bytes + st.deferred_bytes == 0 and st.bytes_read >= 2 * file_bytes - (1 << 20)
    elif fraction == 1.0:  # the whole step in new memory: read once
        assert st.bytes_read == file_bytes and st.rollback_bytes + st.deferred_bytes > file_bytes // 2
    else:  # the head once, the tail twice
        assert file_bytes < st.bytes_read < 2 * file_bytes - file_bytes * fraction / 2
        assert st.rollback_bytes + st.deferred_bytes >= file_bytes * fraction - (256 << 10)


@pytest.mark.parametrize("where", ["head", "tail"])
def test_a_bad_byte_anywhere_leaves_the_callers_tensors_as_they_were(tmp_path, engine, where, monkeypatch):
    monkeypatch.setattr(rstep, "HEAD_FRACTION", 0.5)
    root = str(tmp_path / "ck")
    zerostall.save(root, _state(2.0), step=2)
    man = LocalTier(root).read_manifest(2)
    e = (min if where == "head" else max)(man.tensors, key=lambda t: t.offset)
    flip_byte(os.path.join(root, "step-2", e.file), e.offset + e.nbytes - 3)
    sd = clone(_state(1.0))
    before = clone(sd)
    with pytest.raises(CorruptCheckpoint, match="crc32c"):
        _load(root, engine, sd)
    assert equal(sd, before)


def test_a_failing_gate_or_second_read_rolls_the_head_back(tmp_path, monkeypatch):
    """The head's windows are swapped in while the disk reads; the gate (the ranks'
    agreement) and the tail's second read both come after: either failing puts every
    swapped byte back."""
    monkeypatch.setattr(rstep, "HEAD_FRACTION", 0.5)
    root = str(tmp_path / "ck")
    zerostall.save(root, _state(2.0), step=2)
    sd = clone(_state(1.0))
    before = clone(sd)

    def gate():
        raise DistributedError("another rank failed")
    with pytest.raises(DistributedError, match="another rank"):
        _load(root, "threads", sd, gate=gate)
    assert equal(sd, before)
    real = rstep.read_later

    calls = []

    def read_later(*a, **kw):
        calls.append(1)
        raise OSError("the disk went away before the tail")  # e.g. the files' reopen failed
    monkeypatch.setattr(rstep, "read_later", read_later)
    with pytest.raises(CorruptCheckpoint):
        _load(root, "threads", sd)
    assert calls and equal(sd, before)
    monkeypatch.setattr(rstep, "read_later", real)
    _load(root, "threads", sd)
    assert equal(sd, _state(2.0))


def test_a_second_read_failing_part_way_says_the_state_is_part_loaded(tmp_path, monkeypatch):
    """(adv) The tail's second read writes the caller's tensors as it goes (no memory to keep
    their old bytes): when it fails part way (EIO on the disk, after the step verified), the
    head was rolled back but the tail items already read stayed new, and the error said
    nothing about it (a CorruptCheckpoint, as for a step that changed nothing). The error
    now says the state dict is part loaded (the caller must load again); the head is still
    rolled back when no tail byte was written (test above)."""
    import dataclasses
    import errno
    monkeypatch.setattr(rstep, "HEAD_FRACTION", 0.3)
    root = str(tmp_path / "ck")
    zerostall.save(root, _state(2.0), step=2)
    real = rstep.read_later
    last = max(e.offset + e.nbytes for e in LocalTier(root).read_manifest(2).tensors)

    class Failing:  # the shard's reader: the second pass's read of the step's last bytes fails (a disk error)
        def __init__(self, f):  # the windows before it were checked and copied in before its error is seen
            self.f, self.fd = f, getattr(f, "fd", None)

        def read(self, extents):
            if any(off + len(mv) >= last for off, mv in extents):
                raise OSError(errno.EIO, "injected: Input/output error")
            return self.f.read(extents)

        def close(self):
            self.f.close()

    def read_later(files, *a, **kw):
        files = [dataclasses.replace(fr, open=lambda o=fr.open: Failing(o())) for fr in files]
        return real(files, *a, **kw)
    monkeypatch.setattr(rstep, "read_later", read_later)
    sd = clone(_state(1.0))
    before = clone(sd)
    with pytest.raises(CorruptCheckpoint, match="part loaded") as got:
        _load(root, "threads", sd)
    assert "Input/output error" in str(got.value) and "not modified" not in str(got.value) and got.value.part_loaded
    assert not equal(sd, before)  # what the message says: some of it is the new step's
