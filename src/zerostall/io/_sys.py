"""Thin wrappers for the Linux calls Python's ``os`` lacks or emulates.

``fallocate(2)`` (never ``os.posix_fallocate``: glibc may emulate it by writing zeros
through the page cache), ``sync_file_range(2)``, ``statx(2)`` for STATX_DIOALIGN, the idle
I/O class of a background thread.
"""

from __future__ import annotations

import ctypes
import logging
import os
import threading
from dataclasses import dataclass

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


@dataclass(frozen=True)
class DioAlign:
    mem_align: int
    offset_align: int


class _StatxTimestamp(ctypes.Structure):
    _fields_ = [("tv_sec", ctypes.c_int64), ("tv_nsec", ctypes.c_uint32), ("_r", ctypes.c_int32)]


class _Statx(ctypes.Structure):
    _fields_ = [
        ("stx_mask", ctypes.c_uint32), ("stx_blksize", ctypes.c_uint32),
        ("stx_attributes", ctypes.c_uint64), ("stx_nlink", ctypes.c_uint32),
        ("stx_uid", ctypes.c_uint32), ("stx_gid", ctypes.c_uint32), ("stx_mode", ctypes.c_uint16),
        ("_s0", ctypes.c_uint16), ("stx_ino", ctypes.c_uint64), ("stx_size", ctypes.c_uint64),
        ("stx_blocks", ctypes.c_uint64), ("stx_attributes_mask", ctypes.c_uint64),
        ("stx_atime", _StatxTimestamp), ("stx_btime", _StatxTimestamp),
        ("stx_ctime", _StatxTimestamp), ("stx_mtime", _StatxTimestamp),
        ("stx_rdev_major", ctypes.c_uint32), ("stx_rdev_minor", ctypes.c_uint32),
        ("stx_dev_major", ctypes.c_uint32), ("stx_dev_minor", ctypes.c_uint32),
        ("stx_mnt_id", ctypes.c_uint64), ("stx_dio_mem_align", ctypes.c_uint32),
        ("stx_dio_offset_align", ctypes.c_uint32), ("_spare", ctypes.c_uint64 * 12),
    ]


STATX_DIOALIGN = 0x2000
AT_FDCWD = -100


def statx_dioalign(path: str) -> DioAlign | None:
    """STATX_DIOALIGN of ``path`` (a file or directory); None where the kernel or fs lacks it."""
    fn = getattr(_libc, "statx", None)
    if fn is None:
        return None
    buf = _Statx()
    if fn(AT_FDCWD, os.fsencode(path), 0, STATX_DIOALIGN, ctypes.byref(buf)) != 0:
        return None
    if not buf.stx_mask & STATX_DIOALIGN:
        return None
    return DioAlign(buf.stx_dio_mem_align, buf.stx_dio_offset_align)



def set_idle_io_priority() -> bool:
    """IOPRIO_CLASS_IDLE for the calling thread and the threads it creates later (the uploader,
    the peer replication threads: their disk I/O takes only what the training leaves over),
    through psutil (no per-architecture syscall numbers here). False where the OS refuses."""
    try:
        import psutil
        psutil.Process(threading.get_native_id()).ionice(psutil.IOPRIO_CLASS_IDLE)
        return True
    except Exception as exc:  # noqa: BLE001 - best effort: non-Linux, seccomp, old psutil
        log.debug("zerostall: cannot set idle I/O priority for the replicator: %s", exc)
        return False
