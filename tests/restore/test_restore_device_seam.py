"""The restore pipeline's CUDA copy logic (restore/device_copy.py) run without a GPU.

Real O_DIRECT reads of real checkpoints through restore/stream.py; the one fake is the
``cuda`` seam of :class:`CudaCopier` (streams, events and device contexts that log what
they were asked), so CPU tensors stand in as "device" destinations and the copies are real
``copy_(non_blocking=True)`` calls. What is checked is the pipeline's side of the contract:
the caller's device destinations are written only after every byte verified and the gate
passed (a corrupt step or a failing gate leaves them as they were and copies nothing); new
ones are copied while reading and a ring slot is freed only after its copy's event was
waited for; a copy that raises fails the load, after what was queued was waited for.
The same paths on a real device: tests/restore/test_restore_cuda.py.
"""

import threading

import pytest
import torch

from zerostall.config import IOConfig
from zerostall.errors import CorruptCheckpoint
from zerostall.io.base import get_engine
from zerostall.restore import device_copy
from zerostall.restore import step as rstep
from zerostall.restore import stream
from zerostall.memory.arena import Arena
from zerostall.store.local import LocalTier
from tests.helpers import equal, two_steps
from tests.restore.test_restore_pipeline import SMALL_IO, _dest, _flip_tensor, _state

pytestmark = pytest.mark.timeout(300)


class _Ctx:
    def __enter__(self):
        return self

    def __exit__(self, *a):
        return False


class FakeCuda:
    """torch.cuda's surface that CudaCopier uses; logs (thread, what) in order."""

    def __init__(self):
        self.log: list[tuple[int, str]] = []
        self.lock = threading.Lock()

    def note(self, what):
        with self.lock:
            self.log.append((threading.get_ident(), what))

    def device(self, i):
        return _Ctx()

    def stream(self, s):
        return _Ctx()

    def Stream(self, device=None):  # noqa: N802 - torch's name
        return _Stream(self)

    def current_stream(self, i=None):
        return _Stream(self)

    def Event(self, blocking=False):  # noqa: N802
        return _Event(self)


class _Stream:
    def __init__(self, cuda):
        self.cuda = cuda

    def record_event(self):
        return _Event(self.cuda)

    def wait_event(self, ev):
        self.cuda.note("wait")


class _Event:
    def __init__(self, cuda):
        self.cuda = cuda

    def record(self, s):
        self.cuda.note("record")

    def synchronize(self):
        self.cuda.note("sync")


@pytest.fixture
def fake(monkeypatch):
    cuda = FakeCuda()
    real = device_copy.CudaCopier
    monkeypatch.setattr(stream, "CudaCopier", lambda scratch, devices: real(scratch, devices, cuda=cuda))
    monkeypatch.setattr(device_copy, "register_scratch", lambda scratch, i: cuda.note("register"))
    copy = real.copy

    def logged(self, jobs):
        cuda.note("copy")
        copy(self, jobs)
    monkeypatch.setattr(real, "copy", logged)
    return cuda


def _flat(sd):
    return {f"{p}.{k}": t for p in ("model", "optim") for k, t in sd[p].items()}


def _read(root, step, dests, protected, scratch_bytes, gate=None, cpu=()):
    """Read ``step`` into ``dests`` (key -> tensor) as device destinations (``cpu``: those
    keys as CPU ones, by address), through the real pipeline."""
    tier = LocalTier(root)
    man = tier.read_manifest(step)

    def dst(i):
        t = dests.get(man.tensors[i].key)
        if t is None:
            return (None, None, False)
        if man.tensors[i].key in cpu:
            return (t.data_ptr(), None, protected)
        return (t.data_ptr(), None, protected, t.reshape(-1).view(torch.uint8))
    eng = get_engine("threads", IOConfig(engine="threads", **SMALL_IO))
    arena = Arena(scratch_bytes, mlock=False)
    try:
        files = rstep.file_reads(tier, man, eng, dst, needed=None, only=None, sparse=False)
        return rstep.read_step(files, arena, IOConfig(**SMALL_IO), gate=gate)
    finally:
        eng.close()
        arena.close()


def _ck(tmp_path):
    return two_steps(tmp_path, _state)


def _same(a, b):
    """Every tensor bit-exact (the plain ``step`` value is not read by these reads)."""
    return equal(_flat(a), _flat(b))


def _bytes(sd):
    return sum(t.nbytes for t in _flat(sd).values())


@pytest.mark.parametrize("scratch", [32 << 20, 512 << 10], ids=["staged", "verify-first"])
def test_protected_device_destinations_are_written_only_after_the_gate(tmp_path, fake, scratch):
    root = _ck(tmp_path)
    sd = _dest()
    at_gate = []
    st = _read(root, 2, _flat(sd), True, scratch, gate=lambda: at_gate.append(list(fake.log)))
    assert _same(sd, _state(2.0))
    assert at_gate and not any(w == "copy" for _, w in at_gate[0]), "a device copy ran before the gate"
    assert st.device_bytes == _bytes(sd)
    if scratch == 32 << 20:  # one read, the caller's device bytes staged in the scratch
        assert st.deferred_bytes == _bytes(sd) and st.rollback_bytes == 0


@pytest.mark.parametrize("scratch", [32 << 20, 512 << 10], ids=["staged", "verify-first"])
def test_a_corrupt_step_or_a_failing_gate_leaves_device_destinations_untouched(tmp_path, fake, scratch):
    root = _ck(tmp_path)
    _flip_tensor(root, 2, "optim.m", at=4000)
    sd, before = _dest(), _dest()
    with pytest.raises(CorruptCheckpoint, match=r"optim\.m"):
        _read(root, 2, _flat(sd), True, scratch)
    assert equal(sd, before)
    assert not any(w == "copy" for _, w in fake.log)

    def gate():
        raise RuntimeError("injected: another rank failed")
    with pytest.raises(RuntimeError, match="another rank"):
        _read(root, 1, _flat(sd), True, scratch, gate=gate)
    assert equal(sd, before)
    assert not any(w == "copy" for _, w in fake.log)


def test_mixed_cpu_and_device_destinations_roll_back_together(tmp_path, fake, monkeypatch):
    """CPU destinations swapped in while reading and device ones staged: a corrupt tensor
    late in the step leaves both as they were; a good step fills both."""
    monkeypatch.setattr(stream, "ADAPTIVE", False)  # every CPU window swapped by the copiers
    root = _ck(tmp_path)
    cpu = {"model.w", "model.emb", "optim.s"}
    _flip_tensor(root, 2, "optim.m", at=700_000)
    sd, before = _dest(), _dest()
    with pytest.raises(CorruptCheckpoint, match=r"optim\.m"):
        _read(root, 2, _flat(sd), True, 32 << 20, cpu=cpu)
    assert equal(sd, before)
    st = _read(root, 1, _flat(sd), True, 32 << 20, cpu=cpu)
    assert _same(sd, _state(1.0))
    assert st.device_bytes == sum(t.nbytes for k, t in _flat(sd).items() if k not in cpu)


def test_new_device_tensors_are_copied_while_reading_and_a_slot_is_reused_only_after_its_event(tmp_path, fake,
                                                                                              monkeypatch):
    root = _ck(tmp_path)
    released = []
    real = stream._Run._release

    def release(self, slot):
        fake.note("release")
        released.append(slot)
        real(self, slot)
    monkeypatch.setattr(stream._Run, "_release", release)
    out = {k: torch.empty_like(t) for k, t in _flat(_state(2.0)).items()}
    st = _read(root, 2, out, False, 1 << 20)  # 128 KiB windows, 8 slots: many laps
    assert all(torch.equal(out[k], t) for k, t in _flat(_state(2.0)).items())
    assert st.device_bytes == sum(t.nbytes for t in out.values()) and st.deferred_bytes == 0
    assert len(released) > 8, "the ring did not go round"
    copied = 0
    for tid in {t for t, w in fake.log if w == "copy"}:  # per copier thread: copy, record, sync, release
        seq = [w for t, w in fake.log if t == tid and w in ("copy", "sync", "release")]
        for k, w in enumerate(seq):
            if w == "copy":
                copied += 1
                nxt = seq[k + 1:]
                assert "sync" in nxt and (("release" not in nxt) or nxt.index("sync") < nxt.index("release")), seq
    assert copied > 8


def test_a_device_copy_that_raises_fails_the_load_after_waiting_for_what_was_queued(tmp_path, fake, monkeypatch):
    root = _ck(tmp_path)
    calls = []
    real = device_copy.CudaCopier._pieces

    def pieces(self, src, n):
        calls.append(n)
        if len(calls) == 3:
            raise RuntimeError("injected: CUDA error")
        return real(self, src, n)
    monkeypatch.setattr(device_copy.CudaCopier, "_pieces", pieces)
    out = {k: torch.empty_like(t) for k, t in _flat(_state(2.0)).items()}
    with pytest.raises(RuntimeError, match="injected"):
        _read(root, 2, out, False, 1 << 20)
    seq = [w for _, w in fake.log if w in ("copy", "sync")]
    assert seq.count("sync") >= seq.count("copy")  # every copy call waited for its events, the failing one too
    sd = _dest()
    calls.clear()
    with pytest.raises(RuntimeError, match="injected"):  # staged: the failure is after the gate, raised
        _read(root, 2, _flat(sd), True, 32 << 20, cpu={"model.w"})


def test_cuda_target_names_a_device_only_where_one_exists():
    assert device_copy.cuda_target(None) is None
    assert device_copy.cuda_target("cpu") is None
    assert device_copy.cuda_target({"cuda:0": "cpu"}) is None
    assert device_copy.cuda_target(lambda s, loc: s) is None
    want = torch.device("cuda", 0) if torch.cuda.is_available() else None
    assert device_copy.cuda_target("cuda:0") == want
    assert device_copy.cuda_target({"cpu": "cuda:0"}) == want
    assert device_copy.cuda_target(torch.device("cuda", 0)) == want


def test_the_scratch_is_pinned_once_kept_from_forks_and_copies_cut_at_its_registered_chunks(monkeypatch):
    """register_scratch on an arena view (the pool's) pins its arena, MADV_DONTFORK first,
    once; the copier cuts a copy that crosses two registered chunks (one async copy may not
    span two registrations). cudart faulted at the arena's seam (tests/memory/test_arena_cuda.py)."""
    from tests.memory.test_arena_cuda import FakeCudart, fake_on_device
    from zerostall.memory import arena as zarena
    from zerostall.memory.host import _unforked
    cudart = FakeCudart()
    monkeypatch.setattr(zarena, "_cudart", lambda: cudart)
    monkeypatch.setattr(zarena, "_on_device", fake_on_device)
    monkeypatch.setattr(zarena, "FAULT_CHUNK_BYTES", 1 << 20)
    a = zarena.Arena(4 << 20, mlock=False)
    cudart.arenas.append(a)
    try:
        view = a.view(a.ready)
        assert view.arena is a and a not in _unforked
        device_copy.register_scratch(view, 0)
        device_copy.register_scratch(view, 0)
        assert a in _unforked and a.cuda_registered and a.cuda_pinned_bytes == 4 << 20
        assert len(cudart.regs) == 4  # once: 4 chunks of 1 MiB, not 8
        cuda = FakeCuda()
        cp = device_copy.CudaCopier(view, [None], cuda=cuda)
        assert cp._pieces(a.address + (1 << 20) - 100, 300) == [((1 << 20) - 100, 100), (1 << 20, 200)]
        with pytest.raises(ValueError, match="outside the restore scratch"):
            cp._pieces(a.address + (4 << 20) - 10, 20)
    finally:
        a.close()


@pytest.mark.parametrize("fraction", [0.0, 0.5, 1.0])
def test_a_device_copy_failing_after_the_gate_leaves_every_cpu_destination_as_it_was(tmp_path, fake, monkeypatch,
                                                                                     fraction):
    """(adv) An in-place load of CPU and device destinations whose staged device copy fails
    after the gate (a device fault): the CPU destinations swapped in were rolled back while
    the staged ones had been copied in meanwhile, so the caller's CPU tensors were left half
    of the old step and half of the new. Now the device copy runs first: a fault leaves every
    CPU destination as it was (the device ones may be part written, as documented)."""
    monkeypatch.setattr(stream, "ADAPTIVE", False)  # the windows' fate fixed by the fraction
    monkeypatch.setattr(stream, "ROLLBACK_FRACTION", fraction)  # CPU windows swapped / staged
    monkeypatch.setattr(device_copy.CudaCopier, "_pieces", lambda self, src, n: (_ for _ in ()).throw(
        RuntimeError("injected: device fault")))
    root = _ck(tmp_path)
    cpu = {"model.w", "model.emb", "model.b", "optim.m", "optim.s"}
    sd, before = _dest(), _dest()
    with pytest.raises(RuntimeError, match="device fault"):
        _read(root, 2, _flat(sd), True, 32 << 20, cpu=cpu)
    got, old = _flat(sd), _flat(before)
    assert {k for k in cpu if not torch.equal(got[k], old[k])} == set()
