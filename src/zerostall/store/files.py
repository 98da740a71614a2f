"""Local file helpers of the tiers and the bench: the manifests of a directory, crc32c, dropping
pages, a checked shard open."""

from __future__ import annotations

import os
from typing import Any

import crc32c as _crc

from ..errors import CorruptCheckpoint, StorageError
from ..format.manifest import MANIFEST_NAME
from ..format.validate import open_regular, parse_step_dir

_READ_CHUNK = 8 << 20


def manifest_stat(step_dir: str) -> tuple[int, ...] | tuple[str, int | None] | None:
    """The identity of ``step_dir/manifest.json`` (lstat: a symlink, FIFO or directory counts, to
    be reported as damaged when read); ``("unreadable", errno)`` when it cannot be examined (the
    read says why); None when absent."""
    try:
        st = os.lstat(os.path.join(step_dir, MANIFEST_NAME))
    except (FileNotFoundError, NotADirectoryError):
        return None
    except OSError as exc:
        return ("unreadable", exc.errno)
    return (st.st_dev, st.st_ino, st.st_mode, st.st_size, st.st_mtime_ns, st.st_ctime_ns)


def dir_manifests(root: str) -> dict[int, Any]:
    """{step: :func:`manifest_stat`} of the ``step-N`` entries of ``root`` holding a manifest
    (canonical names only: ``step-03`` is ignored, with a warning). OSError if ``root`` cannot
    be listed."""
    out = {}
    for n in os.listdir(root):
        step = parse_step_dir(n, root)
        if step is not None and (ident := manifest_stat(os.path.join(root, n))) is not None:
            out[step] = ident
    return out


def file_crc32c(path: str) -> tuple[int, int]:
    """(size, crc32c) of a local file, read through the page cache."""
    crc, size = 0, 0
    with open(path, "rb", buffering=0) as f:
        buf = bytearray(_READ_CHUNK)
        mv = memoryview(buf)
        while n := f.readinto(buf):
            crc = _crc.crc32c(mv[:n], crc)
            size += n
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
