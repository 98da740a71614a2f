"""The staging arena's CUDA registration with the runtime faked at its two seams
(``arena._cudart``, ``arena._on_device``): which ranges are registered, on which device, from
which threads, split copies, unregistration before unmapping, failure, and the pool's swap to
a larger reservation. Runs without a GPU; tests/gpu/test_gpu.py runs the real thing."""

import contextlib
import logging
import threading

import pytest

from zerostall.memory import arena as zarena
from zerostall.saving import pool as zpool

MiB = 1 << 20


class FakeCudart:
    """cudaHostRegister/Unregister bookkeeping: no overlap, unregister only what is registered,
    and nothing registered may be unmapped (checked at unregister: the mapping still open)."""

    def __init__(self, fail_at=None):
        self.regs = {}  # address -> size
        self.log = []
        self.fail_at = fail_at
        self.calls = 0
        self.arenas = []

    def cudaHostRegister(self, ptr, size, flags):
        self.calls += 1
        if self.fail_at is not None and self.calls >= self.fail_at:
            return 2  # cudaErrorMemoryAllocation
        assert flags == zarena.CUDA_HOST_REGISTER_PORTABLE
        for p, n in self.regs.items():
            assert ptr + size <= p or p + n <= ptr, "overlapping registration"
        self.regs[ptr] = size
        self.log.append(("reg", ptr, size, threading.current_thread().name, _device.get()))
        return 0

    def cudaHostUnregister(self, ptr):
        assert ptr in self.regs, "unregistering an address that is not registered"
        for a in self.arenas:
            if a.address <= ptr < a.address + a.nbytes:
                assert not a._map.closed, "unregistered after the mapping was closed"
        del self.regs[ptr]
        self.log.append(("unreg", ptr, threading.current_thread().name, _device.get()))
        return 0


class _Device(threading.local):
    index = None

    def get(self):
        return self.index


_device = _Device()


@contextlib.contextmanager
def fake_on_device(index):
    prev, _device.index = _device.index, index
    try:
        yield
    finally:
        _device.index = prev


@pytest.fixture
def cudart(monkeypatch):
    fake = FakeCudart()
    monkeypatch.setattr(zarena, "_cudart", lambda: fake)
    monkeypatch.setattr(zarena, "_on_device", fake_on_device)
    monkeypatch.setattr(zarena, "FAULT_CHUNK_BYTES", 1 * MiB)
    return fake


def _arena(fake, nbytes):
    a = zarena.Arena(nbytes, mlock=False, hugepages=False, prefault=False, detached_views=True)
    fake.arenas.append(a)
    return a


def _covered(fake, a):
    """The registered ranges inside ``a`` as sorted (offset, size)."""
    return sorted((p - a.address, n) for p, n in fake.regs.items() if a.address <= p < a.address + a.nbytes)


def _contiguous_from_zero(ranges, end):
    pos = 0
    for off, n in ranges:
        assert off == pos, (off, pos)
        pos += n
    assert pos == end, (pos, end)


def test_registration_covers_the_faulted_prefix_then_each_new_chunk_on_the_save_device(cudart):
    a = _arena(cudart, 8 * MiB)
    try:
        a.fault_to(3 * MiB + 4096)
        a.wait_ready(3 * MiB + 4096)
        a.register_cuda(2)
        _contiguous_from_zero(_covered(cudart, a), a.ready)
        a.fault_to(8 * MiB)
        a.wait_ready(8 * MiB)
        _contiguous_from_zero(_covered(cudart, a), 8 * MiB)
        assert a.cuda_pinned_bytes == 8 * MiB and a.cuda_error is None
        regs = [e for e in cudart.log if e[0] == "reg"]
        assert all(e[4] == 2 for e in regs), "registered with another device current"
        # never from the caller's thread: a failed call's per-thread error would poison its kernels
        assert all(e[3] != threading.current_thread().name for e in regs)
        a.register_cuda(2)  # once
        assert len([e for e in cudart.log if e[0] == "reg"]) == len(regs)
    finally:
        a.close()
    assert not cudart.regs, "close() left ranges registered"
    unregs = [e for e in cudart.log if e[0] == "unreg"]
    assert len(unregs) == len(regs) and all(e[3] == 2 for e in unregs)
    assert not a.cuda_registered and a.cuda_pinned_bytes == 0


def test_copies_are_split_at_registration_boundaries(cudart):
    a = _arena(cudart, 6 * MiB)
    try:
        assert a.pinned_pieces(100, 5 * MiB) == [(100, 5 * MiB)]  # nothing registered: one piece
        a.register_cuda(0)
        a.fault_to(6 * MiB)
        a.wait_ready(6 * MiB)
        chunks = _covered(cudart, a)
        assert len(chunks) >= 2
        for off, n in [(0, 6 * MiB), (MiB // 2, 2 * MiB), (MiB - 1, 2), (5 * MiB, MiB), (4096, 100)]:
            pieces = a.pinned_pieces(off, n)
            assert sum(k for _, k in pieces) == n and pieces[0][0] == off
            for (o1, k1), (o2, _) in zip(pieces, pieces[1:]):
                assert o1 + k1 == o2
            for o, k in pieces:  # each piece inside one registered chunk
                assert any(c <= o and o + k <= c + cn for c, cn in chunks), (o, k, chunks)
    finally:
        a.close()


def test_a_failed_registration_is_logged_once_and_the_arena_stays_usable(monkeypatch, caplog):
    fake = FakeCudart(fail_at=3)
    monkeypatch.setattr(zarena, "_cudart", lambda: fake)
    monkeypatch.setattr(zarena, "_on_device", fake_on_device)
    monkeypatch.setattr(zarena, "FAULT_CHUNK_BYTES", 1 * MiB)
    a = _arena(fake, 6 * MiB)
    try:
        a.register_cuda(0)
        with caplog.at_level(logging.WARNING, logger="zerostall"):
            a.fault_to(6 * MiB)
            a.wait_ready(6 * MiB)  # no error: the rest is pageable, copies into it are synchronous
        assert a.ready == 6 * MiB and a.error is None
        assert a.cuda_error and "cudaHostRegister" in a.cuda_error and "error 2" in a.cuda_error
        assert fake.calls == 3, "kept calling cudaHostRegister after it failed"
        assert a.cuda_pinned_bytes == 2 * MiB
        assert sum("cudaHostRegister" in r.getMessage() for r in caplog.records) == 1
        pieces = a.pinned_pieces(0, 6 * MiB)
        assert sum(k for _, k in pieces) == 6 * MiB
    finally:
        a.close()
    assert not fake.regs


def test_pool_swap_to_a_larger_reservation_moves_the_registration(cudart, monkeypatch):
    monkeypatch.setattr(zpool, "RESERVE_MIN_BYTES", 8 * MiB)
    real_arena = zpool.Arena

    def tracked(*args, **kw):
        a = real_arena(*args, **kw)
        cudart.arenas.append(a)
        return a

    monkeypatch.setattr(zpool, "Arena", tracked)
    p = zpool.StagingPool(64 * MiB, 1 * MiB, mlock=False, hugepages=False, want=4 * MiB)
    le = zpool.Lease(p, 4 * MiB)
    p.leases.append(le)
    try:
        p._retarget()
        old = p.arena
        old.wait_ready(4 * MiB)
        old.register_cuda(1)  # what the snapshot thread does on the first CUDA save
        assert _covered(cudart, old)
        le.want(24 * MiB)  # above the reservation: a new one, swapped in while idle
        new = p.arena
        assert new is not old and new is p.snap.arena
        assert old.closed and not _covered(cudart, old), "the old reservation is still registered"
        assert new.cuda_registered and new.cuda_device == 1
        new.wait_ready(24 * MiB)
        _contiguous_from_zero(_covered(cudart, new), new.ready)
        assert all(e[4] == 1 for e in cudart.log if e[0] == "reg")
    finally:
        p.leases.clear()
        p.close()
    assert not cudart.regs


def _vmflags(address):
    """The VmFlags of the mapping containing ``address`` in /proc/self/smaps."""
    with open("/proc/self/smaps") as f:
        inside = False
        for line in f:
            head = line.split()[0]
            if "-" in head and ":" not in head:
                lo, hi = (int(x, 16) for x in head.split("-"))
                inside = lo <= address < hi
            elif inside and line.startswith("VmFlags:"):
                return line.split()[1:]
    return None


def test_pool_arenas_are_not_inherited_by_a_forked_child():
    """MADV_DONTFORK: a fork (DataLoader workers) neither copies the arena nor, once it is
    pinned for DMA, has the kernel copy its pages eagerly; the child gets a zero placeholder
    at the address (stale views read zeros, and a collected stale mapping unmaps only that)."""
    import ctypes
    import os

    a = zarena.Arena(4 * MiB, mlock=False, hugepages=False, prefault=True, detached_views=True, dontfork=True)
    plain = zarena.Arena(MiB, mlock=False, hugepages=False, prefault=True)
    try:
        ctypes.memset(a.address, 0xAB, 8192)
        ctypes.memset(plain.address, 0xCD, 16)
        assert "dc" in _vmflags(a.address) and "dc" not in _vmflags(plain.address)
        r, w = os.pipe()
        pid = os.fork()
        if pid == 0:  # the child: ctypes only, no torch, no threads
            try:
                os.close(r)
                seen = ctypes.c_ubyte.from_address(a.address + 4096).value
                ctypes.c_ubyte.from_address(a.address).value = 7  # writable placeholder
                kept = ctypes.c_ubyte.from_address(plain.address).value
                os.write(w, bytes([seen, kept, int(a.forked_copy), int(plain.forked_copy)]))
            finally:
                os._exit(0)
        os.close(w)
        got = os.read(r, 4)
        os.close(r)
        _, status = os.waitpid(pid, 0)
        assert os.WIFEXITED(status) and os.WEXITSTATUS(status) == 0, status
        assert got == bytes([0, 0xCD, 1, 0]), got  # placeholder zeros; a plain arena is inherited
        assert ctypes.c_ubyte.from_address(a.address).value == 0xAB and not a.forked_copy
    finally:
        a.close()
        plain.close()
