"""``uring`` engine: io_uring on an O_DIRECT fd, liburing's C functions called through ctypes.

liburing is the shared library of the PyPI ``liburing`` package (:func:`._sys.liburing`; its
Python binding is never imported). ctypes releases the GIL in each call, so ``io_uring_submit``
and the completion wait never sleep holding it (docs/speed-tricks.md). One ring per open file
(a restore in the caller's thread never shares one with the persist thread), or the persist
thread's long-lived ring with its staging arena registered as fixed buffers; ``queue_depth``
requests of ``chunk_bytes`` in flight; every completion's byte count is checked and short
transfers are resubmitted for the rest.
"""

from __future__ import annotations

import ctypes
import errno
import logging
import os
import threading
from typing import Callable

import numpy as np

from ..config import IOConfig
from ..errors import storage_error
from . import _sys
from .base import Engine, Extent, ShardFile, io_error

log = logging.getLogger("zerostall")


def _prototype(lib: ctypes.CDLL, sig: dict[str, tuple[object, list[object]]]) -> bool:
    """Give ``lib``'s functions named in ``sig`` their (restype, argtypes); whether it has them all."""
    try:
        for name, (res, args) in sig.items():
            fn = getattr(lib, name)
            fn.restype, fn.argtypes = res, args
    except AttributeError:
        return False
    return True


_vp, _u32, _u64 = ctypes.c_void_p, ctypes.c_uint, ctypes.c_uint64
_C_SIG = {"io_uring_queue_init": (ctypes.c_int, [_u32, _vp, _u32]),
          "io_uring_queue_exit": (None, [_vp]),
          "io_uring_get_sqe": (_vp, [_vp]),
          "io_uring_prep_write": (None, [_vp, ctypes.c_int, _vp, _u32, _u64]),
          "io_uring_prep_read": (None, [_vp, ctypes.c_int, _vp, _u32, _u64]),
          "io_uring_sqe_set_data64": (None, [_vp, _u64]),
          "io_uring_submit": (ctypes.c_int, [_vp]),
          "io_uring_wait_cqe": (ctypes.c_int, [_vp, ctypes.POINTER(_vp)]),
          "io_uring_cqe_seen": (None, [_vp, _vp])}
_FIXED_SIG = {"io_uring_register_buffers": (ctypes.c_int, [_vp, _vp, _u32]),
              "io_uring_unregister_buffers": (ctypes.c_int, [_vp]),
              "io_uring_prep_write_fixed": (None, [_vp, ctypes.c_int, _vp, _u32, _u64, ctypes.c_int])}
FIXED_PIECE_BYTES = 1 << 30
"""The kernel's largest registered buffer: a longer region is registered in pieces of this size."""


class _PieceIovec(ctypes.Structure):
    """``struct iovec``: one registered piece."""

    _fields_ = [("base", ctypes.c_void_p), ("len", ctypes.c_size_t)]


class _Cqe(ctypes.Structure):
    _fields_ = [("user_data", ctypes.c_uint64), ("res", ctypes.c_int32), ("flags", ctypes.c_uint32)]


_C = _sys.liburing()
if not _prototype(_C, _C_SIG):
    raise ImportError(f"{_C._name} does not export liburing's C functions")
_HAS_FIXED = _prototype(_C, _FIXED_SIG)
_RING_STRUCT_BYTES = 4096
"""Room for liburing's ``struct io_uring`` (216 bytes in liburing 2.x)."""


class _CRing:
    """One io_uring driven through liburing's C functions by ctypes (GIL released in each call);
    used by one thread at a time, like the file that owns it."""

    def __init__(self, depth: int):
        self.mem = ctypes.create_string_buffer(_RING_STRUCT_BYTES)
        self.ptr = ctypes.addressof(self.mem)
        rc = _C.io_uring_queue_init(depth, self.ptr, 0)
        if rc < 0:
            raise OSError(-rc, os.strerror(-rc))
        self.cqe_ptr = ctypes.c_void_p()
        self.open = True
        self.pinned: tuple[int, int] | None = None
        """(address, bytes) registered with the ring: writes from it skip the kernel's page pinning."""
        self.refused: tuple[int, int] | None = None

    def pin(self, address: int, nbytes: int, fresh: bool = False) -> None:
        """Register ``[address, address + nbytes)`` as fixed buffers (the ring idle; its owner's
        thread); a refusal (the memlock limit, an old kernel) leaves plain writes, not retried."""
        want = (address, nbytes)
        if fresh:  # registered pages are the old mapping's, whatever the address
            self.unpin()
            self.refused = None
        if not _HAS_FIXED or want in (self.pinned, self.refused):
            return
        self.unpin()
        pieces = [(address + o, min(FIXED_PIECE_BYTES, nbytes - o)) for o in range(0, nbytes, FIXED_PIECE_BYTES)]
        iovs = (_PieceIovec * len(pieces))(*pieces)
        rc = _C.io_uring_register_buffers(self.ptr, iovs, len(pieces))
        if rc < 0:
            self.refused = want
            log.debug("zerostall: io_uring refused to register %d bytes as fixed buffers: %s", nbytes, os.strerror(-rc))
            return
        self.pinned = want

    def unpin(self) -> None:
        if self.pinned is not None:
            self.pinned = None
            _C.io_uring_unregister_buffers(self.ptr)

    def queue(self, write: bool, fd: int, addr: int, n: int, off: int, uid: int) -> bool:
        sqe = _C.io_uring_get_sqe(self.ptr)
        if not sqe:
            return False
        p = self.pinned
        i = (addr - p[0]) // FIXED_PIECE_BYTES if write and p is not None and p[0] <= addr else -1
        if i >= 0 and addr + n <= p[0] + p[1] and (addr + n - 1 - p[0]) // FIXED_PIECE_BYTES == i:
            _C.io_uring_prep_write_fixed(sqe, fd, addr, n, off, i)  # inside one registered piece
        else:
            (_C.io_uring_prep_write if write else _C.io_uring_prep_read)(sqe, fd, addr, n, off)
        _C.io_uring_sqe_set_data64(sqe, uid)
        return True

    def submit(self) -> None:
        rc = _C.io_uring_submit(self.ptr)
        if rc < 0:
            raise OSError(-rc, os.strerror(-rc))

    def reap(self) -> tuple[int, int]:
        """Wait for the next completion: (user_data, res), res < 0 being -errno."""
        while True:
            rc = _C.io_uring_wait_cqe(self.ptr, ctypes.byref(self.cqe_ptr))
            if rc == -errno.EINTR:
                continue
            if rc < 0:
                raise OSError(-rc, os.strerror(-rc))
            cqe = _Cqe.from_address(self.cqe_ptr.value)
            uid, res = cqe.user_data, cqe.res
            _C.io_uring_cqe_seen(self.ptr, self.cqe_ptr)
            return uid, res

    def close(self) -> None:
        if self.open:
            self.open = False
            _C.io_uring_queue_exit(self.ptr)


class _UringFile(ShardFile):
    engine: "UringEngine"

    def __init__(self, engine: "UringEngine", path: str, fd: int, writable: bool):
        super().__init__(engine, path, fd, writable)
        self.depth = engine.cfg.queue_depth
        self.cring: _CRing | None = engine.pinned_ring() if writable else None  # long-lived: not this file's
        self.own_cring = self.cring is None
        if self.own_cring:
            try:
                self.cring = _CRing(max(2, self.depth))
            except OSError as exc:
                raise storage_error("io_uring setup for", path, exc,
                                    "io_uring may be disabled; use engine='threads'") from exc

    def _run(self, reqs: list[Extent], write: bool, overlap: Callable[[], None] | None) -> None:
        """The submission loop: ``depth`` requests in flight, ``overlap`` run once submitted,
        short transfers resubmitted, the first error raised once drained."""
        cring, action = self.cring, "write" if write else "read"
        pending = [(off, mv, _address(mv)) for off, mv in reversed(reqs)]
        inflight: dict[int, tuple[int, memoryview, int]] = {}  # keeps each buffer alive until reaped
        next_id = 0
        first_err: BaseException | None = None
        while pending or inflight:
            queued = 0
            while pending and len(inflight) < self.depth and first_err is None:
                off, mv, addr = pending[-1]
                if not cring.queue(write, self.fd, addr, len(mv), off, next_id):
                    break  # the submission queue is full
                inflight[next_id] = pending.pop()
                next_id += 1
                queued += 1
            if queued:
                try:
                    cring.submit()
                except OSError as exc:
                    raise storage_error(f"submitting {action}s of", self.path, exc) from exc
            if overlap is not None:
                try:
                    overlap()
                except BaseException as exc:  # noqa: BLE001 - raised once the ring is drained
                    first_err = first_err or exc
                overlap = None
            if not inflight:
                break
            try:
                uid, res = cring.reap()
            except OSError as exc:
                raise storage_error(f"waiting for {action}s of", self.path, exc) from exc
            off, mv, addr = inflight.pop(uid)
            if 0 < res < len(mv):  # short transfer: resubmit the rest
                pending.append((off + res, mv[res:], addr + res))
            else:
                first_err = first_err or io_error(self.path, action, off, len(mv), res)
        if first_err is not None:
            raise first_err

    def close(self) -> None:
        if not self._closed and self.own_cring:
            self.cring.close()
        super().close()


def _address(mv: memoryview) -> int:
    """The address of a buffer's first byte (read-only ones too, which ctypes refuses: the
    kernel only reads them)."""
    return np.frombuffer(mv, np.uint8).__array_interface__["data"][0]


class UringEngine(Engine):
    name = "uring"
    file_type = _UringFile

    def __init__(self, cfg: IOConfig):
        super().__init__(cfg)
        self._mu = threading.Lock()
        self._local = threading.local()
        self._pinned: list[_CRing] = []  # every thread's long-lived ring, closed with the engine

    def pin_buffer(self, address: int, nbytes: int, *, fresh: bool = False) -> None:
        """The calling thread's files share one long-lived ring with this region registered."""
        if not _HAS_FIXED:
            return
        ring = getattr(self._local, "ring", None)
        if ring is None:
            try:
                ring = _CRing(max(2, self.cfg.queue_depth))
            except OSError:
                return  # each file opens its own ring, and reports the error there
            self._local.ring = ring
            with self._mu:
                self._pinned.append(ring)
        ring.pin(address, nbytes, fresh)

    def pinned_ring(self) -> _CRing | None:
        """The calling thread's long-lived ring (:meth:`pin_buffer`), if it has one."""
        return getattr(self._local, "ring", None)

    def close(self) -> None:
        with self._mu:
            rings, self._pinned = self._pinned, []
        for r in rings:
            r.unpin()
            r.close()
