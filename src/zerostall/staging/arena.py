"""The staging arena: one page-aligned anonymous mapping per process, allocated once, reused.

Created by the ``Checkpointer`` on the first save (caller's thread); written by the snapshot
thread; read by the persist thread. Fresh anonymous memory is slow to touch the first time
(the VM may have to fault and zero every page), so the arena is pre-faulted once
(``MADV_POPULATE_WRITE``, or ``mlock``, which faults too) and then reused for every save.
On CUDA it is registered with ``cudaHostRegister`` once, in chunks of at most 64 GiB, so
device-to-host copies are DMA into it; never ``pin_memory()`` per tensor.
"""

from __future__ import annotations

import ctypes
import logging
import mmap
import os
import resource

import torch

from .._util import node_leader

log = logging.getLogger("zerostall")

MADV_POPULATE_WRITE = getattr(mmap, "MADV_POPULATE_WRITE", 23)
_REGISTER_CHUNK = 64 << 30
_warned_memlock = False

_libc = ctypes.CDLL(None, use_errno=True)
_libc.mlock.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
_libc.munlock.argtypes = [ctypes.c_void_p, ctypes.c_size_t]


def host_ram_bytes() -> int:
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def local_world_size() -> int:
    try:
        return max(1, int(os.environ.get("LOCAL_WORLD_SIZE", "1")))
    except ValueError:
        return 1


def budget_bytes(budget: int | None, fraction: float) -> int:
    """The staging budget of this process: explicit bytes, else a fraction of RAM per local rank."""
    if budget is not None:
        return budget
    return int(host_ram_bytes() * fraction) // local_world_size()


class Arena:
    """``nbytes`` of page-aligned host memory, viewable as bytes and as a uint8 tensor."""

    def __init__(self, nbytes: int, *, mlock: bool = True, hugepages: bool = True,
                 prefault: bool = True):
        self.nbytes = (nbytes + mmap.PAGESIZE - 1) // mmap.PAGESIZE * mmap.PAGESIZE
        self._map = mmap.mmap(-1, self.nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        self.mv = memoryview(self._map)
        self.u8 = torch.frombuffer(self._map, dtype=torch.uint8)
        self.address = ctypes.addressof(ctypes.c_char.from_buffer(self._map))
        self.locked = False
        self.cuda_registered = False
        if hugepages and hasattr(mmap, "MADV_HUGEPAGE"):
            try:
                self._map.madvise(mmap.MADV_HUGEPAGE)
            except OSError:
                pass
        if mlock:
            self.locked = self._try_mlock()
        if prefault and not self.locked:
            self.prefault()

    def _try_mlock(self) -> bool:
        """Lock the arena if RLIMIT_MEMLOCK allows. The limit is the node's setting: only
        LOCAL_RANK 0 warns (once per process), the other local ranks log at debug level."""
        global _warned_memlock
        soft, _ = resource.getrlimit(resource.RLIMIT_MEMLOCK)
        if soft != resource.RLIM_INFINITY and soft < self.nbytes:
            if not _warned_memlock:
                _warned_memlock = True
                say = log.warning if node_leader() else log.debug
                say("zerostall: RLIMIT_MEMLOCK is %d bytes, below the %d-byte staging arena; "
                    "not locking it (raise 'ulimit -l' to keep the arena out of swap)", soft, self.nbytes)
            return False
        if _libc.mlock(ctypes.c_void_p(self.address), self.nbytes) != 0:
            if not _warned_memlock:
                _warned_memlock = True
                say = log.warning if node_leader() else log.debug
                say("zerostall: mlock of the %d-byte staging arena failed: %s",
                    self.nbytes, os.strerror(ctypes.get_errno()))
            return False
        return True

    def prefault(self) -> None:
        """Touch every page now, so no save pays for first-touch page faults."""
        try:
            self._map.madvise(MADV_POPULATE_WRITE)
        except OSError:
            self.u8.zero_()

    def register_cuda(self) -> None:
        """Pin the arena for DMA (once). Called from the snapshot thread on the first CUDA save."""
        if self.cuda_registered:
            return
        cudart = torch.cuda.cudart()
        for off in range(0, self.nbytes, _REGISTER_CHUNK):
            n = min(_REGISTER_CHUNK, self.nbytes - off)
            err = cudart.cudaHostRegister(self.address + off, n, 0)
            if int(err) != 0:
                raise RuntimeError(f"cudaHostRegister of {n} bytes failed with CUDA error {int(err)}")
        self.cuda_registered = True

    def close(self) -> None:
        """Unregister, unlock and unmap. Callers must have stopped using the views."""
        if self._map.closed:
            return
        if self.cuda_registered:
            cudart = torch.cuda.cudart()
            for off in range(0, self.nbytes, _REGISTER_CHUNK):
                cudart.cudaHostUnregister(self.address + off)
            self.cuda_registered = False
        if self.locked:
            _libc.munlock(ctypes.c_void_p(self.address), self.nbytes)
        del self.u8
        self.mv.release()
        try:
            self._map.close()
        except BufferError:  # a tensor view is still alive somewhere; the GC will unmap
            pass
