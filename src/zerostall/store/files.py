"""Local file helpers of the tiers and the bench: a file's crc32c, and dropping its pages.

Any thread; plain reads through the page cache (the caller drops them afterwards).
"""

from __future__ import annotations

import os

import crc32c as _crc

_READ_CHUNK = 8 << 20


def file_crc32c(path: str) -> tuple[int, int]:
    """(size, crc32c) of a local file. Read through the page cache (the upload that follows
    reads the same pages), then dropped from it."""
    crc, size = 0, 0
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        with os.fdopen(os.dup(fd), "rb", buffering=0) as f:
            buf = bytearray(_READ_CHUNK)
            mv = memoryview(buf)
            while n := f.readinto(buf):
                crc = _crc.crc32c(mv[:n], crc)
                size += n
    finally:
        os.close(fd)
    return size, crc


def drop_cache(path: str, *, sync: bool = False) -> None:
    """Ask the kernel to drop ``path``'s clean pages (after an upload read it); ``sync=True``
    writes its dirty pages first, so that all of them go (the bench's cold reads)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    except OSError:
        return
    try:
        if sync:
            os.fdatasync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    except OSError:
        pass
    finally:
        os.close(fd)
