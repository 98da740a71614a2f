"""Page-aligned anonymous host memory for staging, faulted in without the GIL.

Small scratch buffers are ``Arena(nbytes)``, faulted at once in the caller's thread. The
staging pool (:mod:`zerostall.saving.pool`) reserves its budget as address space only
(``prefault=False``); :meth:`Arena.fault_to` has a background thread fault a prefix through
ctypes ``madvise``/``mlock`` calls, which release the GIL (``mmap.madvise`` would hold it),
and writers :meth:`~Arena.wait_ready` for a range.

On CUDA the faulted prefix is registered with ``cudaHostRegister`` chunk by chunk (DMA, never
``pin_memory()`` per tensor), only in threads that launch no kernels (a failed runtime call
leaves a per-thread error torch's next launch there would raise); a failure stops it with one
log line (copies stay correct, only synchronous). Copies are split at chunks (:meth:`Arena.pinned_pieces`).
"""

from __future__ import annotations

import bisect
import contextlib
import ctypes
import logging
import mmap
import os
import resource
import threading
import time
from dataclasses import dataclass
from typing import Any

import torch

from .._util import memlock_fix, node_leader, run_in_fresh_thread, swap_total_bytes
from .host import MADV_HUGEPAGE, MADV_NOHUGEPAGE, _libc, _unforked, populate

log = logging.getLogger("zerostall")

MADV_DONTNEED, MADV_DONTFORK = getattr(mmap, "MADV_DONTNEED", 4), getattr(mmap, "MADV_DONTFORK", 10)
PROBE_BYTES, PROBE_RATIO = 8 << 20, 2.0  # :meth:`Arena._probe_pages`
FAULT_CHUNK_BYTES = 64 << 20  # what the background faulter publishes (and registers with CUDA) at a time
FAULT_CALL_S = 0.004  # target duration of one madvise/mlock call (:meth:`Arena._fault_range`)
FAULT_CALL_MIN_BYTES = 2 << 20  # one transparent huge page
_warned_memlock = False

CUDA_HOST_REGISTER_PORTABLE = 1  # cudaHostRegisterPortable: pinned for every CUDA context


def _cudart():
    """torch's CUDA runtime bindings (the seam unit tests fake to run without a GPU)."""
    return torch.cuda.cudart()


def _on_device(index: int | None):
    """``index`` made the current CUDA device for the block (the seam unit tests fake)."""
    return torch.cuda.device(index) if index is not None else contextlib.nullcontext()


@dataclass(frozen=True)
class ArenaView:
    """A prefix of an arena, shaped like an :class:`Arena` for readers (restore's bounce)."""

    nbytes: int
    mv: memoryview
    u8: torch.Tensor
    address: int
    arena: Any = None  # the arena it views (restore's CUDA copies register it)


class Arena:
    """``nbytes`` of page-aligned host memory, viewable as bytes and as a uint8 tensor, of which
    a prefix of ``ready`` bytes is faulted (all of it with ``prefault=True``). ``fault_to``,
    ``wait_ready``, ``register_cuda``: any thread; ``close``: the owner, once the views are unused."""

    def __init__(self, nbytes: int, *, mlock: bool = True, hugepages: bool = True,
                 prefault: bool = True, detached_views: bool = False, dontfork: bool = False):
        self.nbytes = (nbytes + mmap.PAGESIZE - 1) // mmap.PAGESIZE * mmap.PAGESIZE
        flags = mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | getattr(mmap, "MAP_NORESERVE", 0)
        self._map = mmap.mmap(-1, self.nbytes, flags=flags)
        self.address = ctypes.addressof(ctypes.c_char.from_buffer(self._map))
        if not detached_views:
            self.mv = memoryview(self._map)
            self.u8 = torch.frombuffer(self._map, dtype=torch.uint8)
        else:  # views over the address, so close() unmaps even if a view's export leaked (the pool)
            raw = (ctypes.c_ubyte * self.nbytes).from_address(self.address)
            self.mv = memoryview(raw).cast("B")
            self.u8 = torch.frombuffer(raw, dtype=torch.uint8)
        self.locked = False
        self.closed = False
        self.forked_copy = False  # in a forked child: the memory is a zero placeholder
        self.cuda_registered = False  # asked for (:meth:`register_cuda`); chunks register as they fault
        self.cuda_device: int | None = None
        self.cuda_error: str | None = None  # why registration stopped, or None
        self._cuda_chunks: list[tuple[int, int]] = []  # (offset, bytes) registered, contiguous, in order
        self._cond = threading.Condition()
        self.ready = 0  # bytes of the prefix faulted (and locked / CUDA-registered if asked)
        self.target = 0
        self._faulter: threading.Thread | None = None
        self._closing = False
        self.error: BaseException | None = None
        self.fault_s = 0.0
        self._call_bytes = FAULT_CALL_MIN_BYTES  # grows to what FAULT_CALL_S faults (faulter thread)
        if dontfork:  # a fork (DataLoader workers) copies neither its page tables nor its DMA-pinned pages
            self.keep_from_fork()
        self.pages = "4k"  # or "huge" (advised and not slower: _probe_pages), "probing" until then
        self._small_rate = 0.0  # bytes/s of the 4 KiB probe
        if hugepages:
            with contextlib.suppress(OSError, ValueError):
                self._map.madvise(MADV_HUGEPAGE)  # only sets a flag on the mapping: instant
                self.pages = "probing"
        if mlock:
            self.locked = self._memlock_allows(self.nbytes)
        if prefault:
            self.target = self.nbytes
            self._fault_range(0, self.nbytes)
            self.ready = self.nbytes

    # -- faulting ---------------------------------------------------------------------------
    def _memlock_allows(self, nbytes: int) -> bool:
        """Whether RLIMIT_MEMLOCK allows locking ``nbytes`` (if not, said once per node)."""
        global _warned_memlock
        soft, hard = resource.getrlimit(resource.RLIMIT_MEMLOCK)
        if soft != resource.RLIM_INFINITY and soft < nbytes:
            if not _warned_memlock:
                _warned_memlock = True
                say = (log.warning if swap_total_bytes() else log.info) if node_leader() else log.debug
                say("zerostall: RLIMIT_MEMLOCK is %d bytes, below the %d-byte staging budget: the arena is "
                    "not locked%s; fix: %s", soft, nbytes,
                    "" if swap_total_bytes() else " (no swap on this node: it stays resident anyway)",
                    memlock_fix(nbytes, hard))
            return False
        return True

    def _fault_range(self, off: int, n: int) -> None:
        """Fault [off, off+n) in calls of about :data:`FAULT_CALL_S` each, no GIL held: each
        call holds the process's mmap lock, which every ``mmap``/``munmap`` waits behind."""
        end = off + n
        if self.pages == "probing":
            off += self._probe_pages(off, n)
        while off < end:
            k = min(self._call_bytes, end - off)
            t0 = time.perf_counter()
            self._fault_once(off, k)
            dt = time.perf_counter() - t0
            off += k
            if self.pages == "huge" and k * PROBE_RATIO < dt * self._small_rate and off < self.nbytes:
                self._use_small(off, f"{k / dt / 1e9:.2f} GB/s")  # the kernel's free huge pages ran out
            if k == self._call_bytes:  # a full call: size the next one from its rate
                fit = int(k / max(dt, 1e-6) * FAULT_CALL_S) // FAULT_CALL_MIN_BYTES * FAULT_CALL_MIN_BYTES
                self._call_bytes = max(FAULT_CALL_MIN_BYTES, min(FAULT_CHUNK_BYTES, fit))

    def _probe_pages(self, off: int, n: int) -> int:
        """Fault ``PROBE_BYTES`` of huge, then of 4 KiB pages, timing each (huge pages can fault
        far slower on a VM); returns the bytes faulted."""
        if n < 2 * PROBE_BYTES:
            if self.nbytes - off < 2 * PROBE_BYTES:  # no room left for a probe: huge pages as advised
                self.pages = "huge"
            return 0
        self.pages = "huge"
        p, rest = PROBE_BYTES, self.address + off + PROBE_BYTES
        t0 = time.perf_counter()
        self._fault_once(off, p)
        t1 = time.perf_counter()
        _libc.madvise(ctypes.c_void_p(rest), self.nbytes - off - p, MADV_NOHUGEPAGE)
        self._fault_once(off + p, p)
        t2 = time.perf_counter()
        _libc.madvise(ctypes.c_void_p(rest + p), self.nbytes - off - 2 * p, MADV_HUGEPAGE)
        huge_rate, self._small_rate = p / max(t1 - t0, 1e-9), p / max(t2 - t1, 1e-9)
        if huge_rate * PROBE_RATIO < self._small_rate:  # the 4 KiB probe stays as it is
            self._use_small(off + 2 * PROBE_BYTES, f"{huge_rate / 1e9:.2f} GB/s")
        return 2 * PROBE_BYTES

    def _use_small(self, off: int, why: str) -> None:
        """4 KiB pages from ``off`` on: huge pages faulted at ``why``, under 1/PROBE_RATIO of them."""
        self.pages = "4k"
        _libc.madvise(ctypes.c_void_p(self.address + off), self.nbytes - off, MADV_NOHUGEPAGE)
        log.debug("zerostall: huge pages fault at %s, 4 KiB pages at %.2f GB/s: 4 KiB pages from offset %d",
                  why, self._small_rate / 1e9, off)

    def _fault_once(self, off: int, n: int) -> None:
        """Fault [off, off+n): mlock (which faults too) when locking, else populate."""
        global _warned_memlock
        if self.locked:
            if _libc.mlock(ctypes.c_void_p(self.address + off), n) == 0:
                return
            if not _warned_memlock:
                _warned_memlock = True
                say = log.warning if node_leader() else log.debug
                say("zerostall: mlock of the staging arena failed: %s", os.strerror(ctypes.get_errno()))
            if off > 0:
                _libc.munlock(ctypes.c_void_p(self.address), off)
            self.locked = False
        populate(self.address + off, n)

    def fault_to(self, nbytes: int) -> None:
        """Ask the background faulter to make the first ``nbytes`` ready; returns at once."""
        nbytes = min(self.nbytes, (nbytes + mmap.PAGESIZE - 1) // mmap.PAGESIZE * mmap.PAGESIZE)
        with self._cond:
            if nbytes <= self.target:
                return
            self.target = nbytes
            if self._faulter is None:
                self._faulter = threading.Thread(target=self._fault_loop, name="zerostall-fault", daemon=True)
                self._faulter.start()
            self._cond.notify_all()

    def _fault_loop(self) -> None:
        while True:
            with self._cond:
                while self.ready >= self.target and not self._closing:
                    self._cond.wait()
                if self._closing:
                    return
                off = self.ready
                n = min(FAULT_CHUNK_BYTES, self.target - off)
            t0 = time.perf_counter()
            try:
                self._fault_range(off, n)  # no lock held, no GIL held: writers use [0, ready) meanwhile
                with self._cond:  # register_cuda() holds the lock too: no chunk is missed
                    if self.cuda_registered and self.cuda_error is None:
                        with _on_device(self.cuda_device):
                            self._cuda_register(off, n)
                    self.ready = off + n
                    self._cond.notify_all()
            except BaseException as exc:  # noqa: BLE001 - handed to the writers waiting on it
                log.error("zerostall: faulting the staging arena failed: %s", exc)
                with self._cond:
                    self.error = exc
                    self._cond.notify_all()
                return
            self.fault_s += time.perf_counter() - t0

    def wait_ready(self, end: int) -> None:
        """Block until ``[0, end)`` is faulted (asking for it if nobody has)."""
        if self.ready >= end:
            return
        self.fault_to(end)
        with self._cond:
            while self.ready < end and not self._closing and self.error is None:
                self._cond.wait()
            if self.error is not None and self.ready < end:
                raise RuntimeError(f"the staging arena could not be prepared: {self.error}") from self.error

    def view(self, nbytes: int) -> ArenaView:
        n = min(nbytes, self.nbytes)
        return ArenaView(n, self.mv[:n], self.u8[:n], self.address, self)

    # -- CUDA -------------------------------------------------------------------------------
    def _cuda_register(self, off: int, n: int) -> None:
        """Register one chunk (lock held; in a thread that launches no kernels); a failure stops
        registration for good."""
        if self.cuda_error is not None:
            return
        err = int(_cudart().cudaHostRegister(self.address + off, n, CUDA_HOST_REGISTER_PORTABLE))
        if err != 0:
            self.cuda_error = f"cudaHostRegister of {n} bytes at offset {off} failed with CUDA error {err}"
            say = log.warning if node_leader() else log.debug
            say("zerostall: %s; device-to-host copies into the rest of the staging arena are synchronous "
                "(pinned-memory limit? %d bytes registered)", self.cuda_error, self.cuda_pinned_bytes)
            return
        self._cuda_chunks.append((off, n))

    @property
    def cuda_pinned_bytes(self) -> int:
        return sum(n for _, n in self._cuda_chunks)

    def keep_from_fork(self) -> None:
        """``MADV_DONTFORK``: a forked child gets a zero placeholder instead of a copy."""
        if self not in _unforked and _libc.madvise(ctypes.c_void_p(self.address), self.nbytes, MADV_DONTFORK) == 0:
            _unforked.add(self)

    def register_cuda(self, device: int | None = None) -> None:
        """Pin the faulted prefix for DMA now, and every chunk the faulter adds later, with CUDA
        ``device`` current. The snapshot thread on the first CUDA save, or the pool."""
        with self._cond:
            if self.cuda_registered:
                return
            self.cuda_device = device
            # hold the lock so the faulter does not publish a chunk between the two steps

            def prefix() -> None:
                with _on_device(device):
                    for off in range(0, self.ready, FAULT_CHUNK_BYTES):
                        self._cuda_register(off, min(FAULT_CHUNK_BYTES, self.ready - off))

            if self.ready:
                run_in_fresh_thread(prefix, "zerostall-cuda-register")  # its CUDA errors die with it
            self.cuda_registered = True

    def pinned_pieces(self, off: int, n: int) -> list[tuple[int, int]]:
        """``[off, off+n)`` as (offset, length) pieces, none crossing two registered chunks (a
        copy spanning two fails with cudaErrorInvalidValue). Any thread."""
        with self._cond:
            bounds = [start + k for start, k in self._cuda_chunks]  # each chunk's end: the next one's start
        out = []
        end = off + n
        while off < end:
            i = bisect.bisect_right(bounds, off)
            k = min(end, bounds[i] if i < len(bounds) else end) - off
            out.append((off, k))
            off += k
        return out

    # -- teardown ---------------------------------------------------------------------------
    def close(self) -> None:
        """Stop the faulter, unregister, unlock and unmap. Callers must have stopped using the views."""
        if self.closed:
            return
        with self._cond:
            self._closing = True
            self._cond.notify_all()
        if self._faulter is not None:
            self._faulter.join()
        if self._cuda_chunks:  # before munlock/munmap: the driver holds these pages
            chunks, device = list(self._cuda_chunks), self.cuda_device

            def unregister() -> None:
                cudart = _cudart()
                with _on_device(device):
                    for off, _ in chunks:
                        cudart.cudaHostUnregister(self.address + off)

            try:
                run_in_fresh_thread(unregister, "zerostall-cuda-register")
            except Exception as exc:  # noqa: BLE001 - e.g. CUDA already shut down at exit
                log.debug("zerostall: cudaHostUnregister of the staging arena failed: %s", exc)
            self._cuda_chunks.clear()
        self.cuda_registered = False
        if self.locked:
            _libc.munlock(ctypes.c_void_p(self.address), self.ready)
        # give the memory back now even if a stray view keeps the mapping alive until the GC
        _libc.madvise(ctypes.c_void_p(self.address), self.nbytes, MADV_DONTNEED)
        self.ready = 0
        self.closed = True
        del self.u8
        self.mv.release()
        with contextlib.suppress(BufferError):  # a tensor view is still alive somewhere; the GC will unmap
            self._map.close()
