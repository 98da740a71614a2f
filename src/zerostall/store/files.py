"""Local file helpers of the tiers and the bench: crc32c, dropping pages, a checked shard open."""

from __future__ import annotations

import os
from typing import Any

import crc32c as _crc

from ..errors import CorruptCheckpoint, StorageError
from ..format.validate import open_regular

_READ_CHUNK = 8 << 20


def file_crc32c(path: str) -> tuple[int, int]:
    """(size, crc32c) of a local file, read through the page cache."""
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
    """Ask the kernel to drop ``path``'s clean pages; ``sync=True`` writes dirty ones first."""
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


def open_shard_checked(eng: Any, path: str) -> Any:
    """``eng.open_read(path)`` only if ``path`` is a regular file and the one that was checked
    (not replaced before the engine's open); else :class:`CorruptCheckpoint`."""
    try:
        fd = open_regular(path)
    except FileNotFoundError:
        raise CorruptCheckpoint(f"{path}: shard file is missing", path=path) from None
    try:
        st = os.fstat(fd)
        try:
            f = eng.open_read(path)
        except StorageError as exc:
            raise CorruptCheckpoint(f"{path}: cannot open shard: {exc}", path=path) from exc
        fno = getattr(f, "fd", None)
        st2 = os.fstat(fno) if isinstance(fno, int) else st
        if (st2.st_dev, st2.st_ino) != (st.st_dev, st.st_ino):
            f.close()
            raise CorruptCheckpoint(f"{path}: the shard was replaced while it was being opened", path=path)
        return f
    finally:
        os.close(fd)
