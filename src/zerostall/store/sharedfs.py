"""The shared-filesystem tier: ``file:///path`` or a plain path (Lustre, GPFS, NFS, ...).

The remote layout in a directory every node mounts: files are written with the probed engine
as ``name.part``, fdatasync'ed and renamed; the manifest last (the commit).
"""

from __future__ import annotations

import errno as _errno
import logging
import os
import shutil
from typing import Any, Callable
from urllib.parse import urlparse

import crc32c as _crc

from ..config import ALIGN_BYTES, IOConfig
from ..errors import CheckpointNotFound, CorruptCheckpoint, RemoteError, RootNotFound, ZerostallError
from ..format.validate import open_regular, read_upto
from .files import dir_manifests, drop_cache, file_crc32c
from .remote import RemoteTier, ShardIO
from ..io import choose_engine
from ..memory.arena import Arena
from .atomic import fsync_dir, write_file_durable

log = logging.getLogger("zerostall")


class FileTier(RemoteTier):
    def __init__(self, url: str, io: IOConfig | None = None, **_: Any):
        self.url = url
        self.root = urlparse(url).path if url.startswith("file://") else url
        self.io = io or IOConfig()

    def check_root(self) -> None:
        if os.path.lexists(self.root) and not os.path.isdir(self.root):
            raise RootNotFound(f"{self.url}: {self.root!r} is not a directory (check the URL)", root=self.url)
        if not os.path.isdir(self.root):
            raise RootNotFound(f"{self.url}: directory {self.root!r} does not exist (check the URL; the "
                               "replicator creates it at its first upload)", root=self.url)

    def _path(self, rel: str) -> str:
        return os.path.join(self.root, rel)

    def _unlink_step_link(self, rel: str) -> None:
        """Remove a step directory that is a symlink (never its target) before anything is
        written or removed under it (else a sweep would delete files outside the tier)."""
        top = self._path(rel.split("/", 1)[0])
        if "/" in rel and os.path.islink(top):
            log.warning("zerostall: %s is a symlink, not a checkpoint directory: removing the link (not what it "
                        "points to) before writing there", top)
            self._delete(rel.split("/", 1)[0])

    def _err(self, action: str, rel: str, exc: OSError) -> RemoteError:
        what = os.strerror(exc.errno) if exc.errno else str(exc)
        return self.error(rel, f"{action} {self.where(rel)} failed: {what}", errno=exc.errno)

    def _stream(self, src: str, sink: Callable[[int, memoryview], None]) -> int:
        """Read ``src`` with the engine through one aligned bounce buffer; returns its size."""
        size = os.path.getsize(src)
        eng = choose_engine(self.root, self.io)
        buf = Arena(min(64 << 20, max(size, ALIGN_BYTES)), mlock=False)
        try:
            with eng.open_read(src) as r:
                for off in range(0, size, buf.nbytes):
                    n = min(buf.nbytes, size - off)
                    r.read([(off, buf.mv[:n])])
                    sink(off, buf.mv[:n])
        finally:
            eng.close()
            buf.close()
        return size

    def _copy(self, src: str, dst: str) -> None:
        """Aligned streaming copy through one bounce buffer (files are 4 KiB multiples)."""
        size = os.path.getsize(src)
        os.makedirs(os.path.dirname(dst), exist_ok=True)
        tmp = dst + ".part"
        if os.path.exists(tmp):
            os.unlink(tmp)
        eng = choose_engine(self.root, self.io)
        try:
            with eng.open_write(tmp, size) as w:
                self._stream(src, lambda off, mv: w.write([(off, mv)]))
                w.finish()
        finally:
            eng.close()
        os.rename(tmp, dst)

    def ensure_root(self) -> None:
        try:
            os.makedirs(self.root, exist_ok=True)
        except OSError as exc:
            raise self._err("creating", "", exc) from exc

    def _put_file(self, local_path: str, rel: str, crc: int) -> None:
        self._unlink_step_link(rel)
        try:
            self._copy(local_path, self._path(rel))
        except (OSError, ZerostallError) as exc:
            raise self.error(rel, f"copying {local_path} to {self.where(rel)} failed: {exc}") from exc

    def _put_bytes(self, data: bytes, rel: str) -> None:
        self._unlink_step_link(rel)
        dst = self._path(rel)
        try:
            os.makedirs(os.path.dirname(dst), exist_ok=True)
            write_file_durable(dst + ".part", data)
            os.rename(dst + ".part", dst)
            fsync_dir(os.path.dirname(dst))
        except OSError as exc:
            raise self._err("writing", rel, exc) from exc

    def checksum(self, rel: str) -> tuple[int, int]:
        """Shards are re-read with direct I/O (not from the page cache); small unaligned files
        (manifests) through the cache, then dropped."""
        path, crc = self._path(rel), 0

        def add(off: int, mv: memoryview) -> None:
            nonlocal crc
            crc = _crc.crc32c(mv, crc)

        try:
            if os.path.getsize(path) % ALIGN_BYTES:
                size, crc = file_crc32c(path)
                drop_cache(path)
            else:
                size = self._stream(path, add)
        except OSError as exc:
            raise self._err("reading back", rel, exc) from exc
        return size, crc

    def read_bytes(self, rel: str, limit: int) -> bytes:
        """Regular files only: anything else, or a step directory that is a symlink, is
        CorruptCheckpoint naming the file."""
        top = self._path(rel.split("/", 1)[0])
        if "/" in rel and os.path.islink(top):
            raise CorruptCheckpoint(f"{self.where(rel)}: {top} is a symlink; a checkpoint's files must live "
                                    "inside the checkpoint directory", path=self.where(rel))
        try:
            fd = open_regular(self._path(rel))
        except FileNotFoundError:
            raise CheckpointNotFound(f"{self.where(rel)} does not exist") from None
        try:
            return read_upto(fd, limit)
        except OSError as exc:
            raise self._err("reading", rel, exc) from exc
        finally:
            os.close(fd)

    def stat(self, rel: str) -> int | None:
        try:
            return os.stat(self._path(rel)).st_size
        except FileNotFoundError:
            return None
        except OSError as exc:
            raise self._err("stat of", rel, exc) from exc

    def _manifests(self) -> dict[int, Any]:
        try:
            return dir_manifests(self.root)
        except FileNotFoundError:
            return {}
        except OSError as exc:
            raise self._err("listing", "", exc) from exc

    def _open_read(self, rel: str, size: int, engine: Any) -> Any:
        eng = engine or choose_engine(self.root, self.io)
        try:
            inner = eng.open_read(self._path(rel))
        except (OSError, ZerostallError) as exc:
            if engine is None:
                eng.close()
            raise self.error(rel, f"opening {self.where(rel)} failed: {exc}") from exc
        return ShardIO(inner, on_close=eng.close if engine is None else None)

    def _delete(self, rel: str) -> None:
        self._unlink_step_link(rel)
        try:
            os.unlink(self._path(rel))
        except FileNotFoundError:
            pass
        except OSError as exc:
            raise self._err("deleting", rel, exc) from exc

    def names_in(self, step: int) -> list[str]:
        if os.path.islink(self._path(f"step-{step}")):
            return []  # not a checkpoint directory (what it points to is not the tier's)
        try:
            return sorted(os.listdir(self._path(f"step-{step}")))
        except FileNotFoundError:
            return []
        except OSError as exc:
            raise self._err("listing", f"step-{step}/", exc) from exc

    def _copy_within(self, src: str, dst: str) -> bool:
        """A hard link where the filesystem has them (files here are replaced by rename, never in place)."""
        self._unlink_step_link(dst)
        s, d = self._path(src), self._path(dst)
        linked = True
        try:
            if os.path.lexists(d):
                os.unlink(d)
            try:
                os.link(s, d)
            except OSError as exc:
                if exc.errno not in (_errno.EXDEV, _errno.EPERM, _errno.EOPNOTSUPP, _errno.EMLINK):
                    raise
                self._copy(s, d)
                linked = False
            fsync_dir(os.path.dirname(d))
        except OSError as exc:
            raise self._err(f"copying {self.where(src)} to", dst, exc) from exc
        return linked

    def _delete_prefix(self, rel: str) -> None:
        self._unlink_step_link(rel)
        shutil.rmtree(self._path(rel), ignore_errors=True)
