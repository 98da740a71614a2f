"""Thin wrappers for the Linux calls Python's ``os`` lacks or emulates: ``fallocate(2)`` (never
``os.posix_fallocate``: glibc may emulate it by writing zeros), ``sync_file_range(2)``,
``statx(2)`` for STATX_DIOALIGN, the idle I/O class of a background thread, liburing's C library.
"""

from __future__ import annotations

import ctypes
import importlib.util
import logging
import os
import struct
import threading

from .._fast import libc as _libc

log = logging.getLogger("zerostall")

SYNC_FILE_RANGE_WAIT_BEFORE = 1
SYNC_FILE_RANGE_WRITE = 2
SYNC_FILE_RANGE_WAIT_AFTER = 4
RWF_DONTCACHE = 0x00000080  # Linux 6.14+: buffered I/O that drops its pages once written back


def _raise(path: str | None = None) -> None:
    err = ctypes.get_errno()
    raise OSError(err, os.strerror(err), path)


def fallocate(fd: int, offset: int, length: int, path: str | None = None) -> None:
    """Reserve blocks for ``[offset, offset+length)``; OSError(EOPNOTSUPP) where unsupported."""
    if length > 0 and _libc.fallocate64(fd, 0, offset, length) != 0:
        _raise(path)


def sync_file_range(fd: int, offset: int, nbytes: int, flags: int) -> None:
    if _libc.sync_file_range(fd, offset, nbytes, flags) != 0:
        _raise()


STATX_DIOALIGN = 0x2000
_STATX_BYTES = 256
_STATX_DIO_OFFSET = 152  # struct statx: stx_mask (u32) at 0, stx_dio_mem_align, stx_dio_offset_align here


def statx_dioalign(path: str) -> tuple[int, int] | None:
    """STATX_DIOALIGN of ``path`` (a file or directory): (memory, offset) alignment; None where
    the kernel or fs lacks it."""
    fn = getattr(_libc, "statx", None)
    buf = ctypes.create_string_buffer(_STATX_BYTES)
    if fn is None or fn(-100, os.fsencode(path), 0, STATX_DIOALIGN, buf) != 0:  # -100: AT_FDCWD
        return None
    if not struct.unpack_from("=I", buf, 0)[0] & STATX_DIOALIGN:
        return None
    return struct.unpack_from("=II", buf, _STATX_DIO_OFFSET)


def set_idle_io_priority() -> bool:
    """IOPRIO_CLASS_IDLE for the calling thread and the threads it creates later; False if refused."""
    try:
        import psutil
        psutil.Process(threading.get_native_id()).ionice(psutil.IOPRIO_CLASS_IDLE)
        return True
    except Exception as exc:  # noqa: BLE001 - best effort: non-Linux, seccomp, old psutil
        log.debug("zerostall: cannot set idle I/O priority for the replicator: %s", exc)
        return False


def liburing() -> ctypes.CDLL:
    """liburing's C library as the PyPI ``liburing`` package ships it. Its Python binding is never
    imported: each of its calls holds the GIL, and its builds can use CPU instructions a host lacks
    (AVX-512: SIGILL). ImportError saying why where it cannot be loaded."""
    spec = importlib.util.find_spec("liburing")
    if spec is None or not spec.submodule_search_locations:
        raise ImportError("the liburing package is not installed")
    path = os.path.join(list(spec.submodule_search_locations)[0], "liburing.so")
    try:
        return ctypes.CDLL(path)
    except OSError as exc:
        raise ImportError(f"cannot load {path}: {exc}") from None
