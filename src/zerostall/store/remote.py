"""Remote tiers: where committed checkpoints are trickled to, chosen by URL.

Every tier stores the local layout under its root (``<root>/step-N/<shard files>``,
``<root>/step-N/manifest.json``) and commits the object-store way: data first, each object
verified by re-reading its crc32c from the tier, the manifest last, so a remote checkpoint
exists only once complete (a step is *committed* on a tier when its manifest is there).
Called from the replicator thread (uploads, deletes) and from ``load``/the CLI (listing,
downloads); one thread per tier object, except :meth:`RemoteTier.cancel`, which any thread
may call.

Faults are contained at this boundary: every OS or botocore error leaves as a
:class:`~zerostall.errors.RemoteError` naming the URL (and step), and nothing here loops on
retries — S3 requests use botocore's own bounded ``standard`` retry mode (see
:mod:`.s3`); a step that fails stays pending and the replicator tries it again at its next
pass. :func:`list_steps` bounds a listing by a short timeout for readers that must not wait
on a remote that is down (restore from local, ``steps()``).

Registry (:mod:`.tier`; fsspec-style, lazy, with install hints): ``s3://bucket/prefix`` -> :class:`S3Tier`
(boto3; ``pip install 'zerostall[s3]'``), ``file:///path`` or a plain path -> :class:`FileTier`
(a shared or parallel filesystem: Lustre, GPFS, NFS with one file per rank).
"""

from __future__ import annotations

import errno as _errno
import logging
import os
import re
import shutil
import threading
from abc import ABC, abstractmethod
from typing import Any, Callable
from urllib.parse import urlparse

import crc32c as _crc

from ..config import ALIGN_BYTES, IOConfig
from ..errors import RemoteError, ZerostallError
from ..format.manifest import MANIFEST_NAME, MAX_MANIFEST_BYTES
from .tier import open_tier, register_tier  # noqa: F401 - the registry lives in .tier; kept importable here

log = logging.getLogger("zerostall")
_STEP_RE = re.compile(r"^step-(\d{1,19})$")
LIST_TIMEOUT_S = 10.0
"""How long a reader waits for a remote listing before going on without it."""
_READ_CHUNK = 8 << 20


def step_of(rel: str) -> int | None:
    m = _STEP_RE.match(rel.split("/", 1)[0])
    return int(m.group(1)) if m else None


class RemoteTier(ABC):
    """One remote location. Used by one thread at a time (``cancel`` from any thread)."""

    url: str

    # -- listing and reading ----------------------------------------------------------------
    @abstractmethod
    def steps(self) -> list[int]:
        """Committed steps (their manifest object exists), ascending; raises RemoteError."""

    @abstractmethod
    def read_bytes(self, rel: str, limit: int) -> bytes:
        """At most ``limit + 1`` bytes of ``rel`` (so callers can tell "over the limit")."""

    @abstractmethod
    def stat(self, rel: str) -> int | None:
        """Size of ``rel`` in bytes, or None when it does not exist."""

    @abstractmethod
    def checksum(self, rel: str) -> tuple[int, int]:
        """(size, crc32c) of what the tier stores for ``rel``, recomputed by reading it back."""

    @abstractmethod
    def download(self, rel: str, local_path: str, size: int) -> None:
        """Fetch ``rel`` into ``local_path`` (created; direct I/O where the engine allows)."""

    # -- writing (replicator thread) ------------------------------------------------------------
    @abstractmethod
    def ensure_root(self) -> None:
        """Create the bucket / directory if it does not exist."""

    @abstractmethod
    def _put_file(self, local_path: str, rel: str, crc: int) -> None: ...

    @abstractmethod
    def _put_bytes(self, data: bytes, rel: str) -> None: ...

    @abstractmethod
    def _delete(self, rel: str) -> None:
        """Remove one object/file (absent is fine)."""

    @abstractmethod
    def delete_step(self, step: int) -> None:
        """Remove a step: the manifest first (uncommit), then the data."""

    def cancel(self) -> None:
        """Abandon in-flight transfers (the close deadline passed); any thread."""

    # -- shared logic -------------------------------------------------------------------------
    def upload(self, local_path: str, rel: str, crc: int | None = None) -> None:
        """Copy a local file to ``rel`` and verify it end to end: the crc32c of the bytes the
        tier stores (read back) must equal the local file's. A mismatch removes the object and
        raises RemoteError."""
        if crc is None:
            _, crc = file_crc32c(local_path)
        self._put_file(local_path, rel, crc)
        self.verify(rel, os.path.getsize(local_path), crc)

    def upload_bytes(self, data: bytes, rel: str) -> None:
        """Store ``data`` at ``rel`` and read it back to check it (manifests: small). If the
        check cannot be made, the object is removed again: an unverified manifest must not
        commit a step."""
        self._put_bytes(data, rel)
        try:
            self.verify(rel, len(data), _crc.crc32c(data))
        except BaseException:
            try:
                self._delete(rel)
            except ZerostallError as exc:
                log.warning("zerostall: cannot remove unverified %s: %s", self.where(rel), exc)
            raise

    def verify(self, rel: str, size: int, crc: int) -> None:
        got_size, got_crc = self.checksum(rel)
        if (got_size, got_crc) != (size, crc):
            try:
                self._delete(rel)
            finally:
                raise RemoteError(f"{self.where(rel)}: the tier stores {got_size} bytes with crc32c {got_crc:08x}, "
                                  f"sent {size} bytes with crc32c {crc:08x}; the object was removed and will "
                                  "be uploaded again", url=self.where(rel), step=step_of(rel))

    def read_manifest_bytes(self, step: int) -> bytes:
        data = self.read_bytes(f"step-{step}/{MANIFEST_NAME}", MAX_MANIFEST_BYTES)
        if len(data) > MAX_MANIFEST_BYTES:
            raise RemoteError(f"{self.where(f'step-{step}/{MANIFEST_NAME}')}: manifest is over the "
                              f"{MAX_MANIFEST_BYTES} byte limit", url=self.url, step=step)
        return data

    def where(self, rel: str = "") -> str:
        return f"{self.url.rstrip('/')}/{rel}" if rel else self.url


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


def drop_cache(path: str) -> None:
    """Ask the kernel to drop ``path``'s clean pages (after an upload read it)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    except OSError:
        return
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    except OSError:
        pass
    finally:
        os.close(fd)


def list_steps(remote: RemoteTier, timeout_s: float = LIST_TIMEOUT_S) -> tuple[list[int] | None, str]:
    """(the remote's committed steps, "") or (None, why) — logged as a warning — if the
    listing fails or takes longer than ``timeout_s`` (a hung mount, a blackholed endpoint):
    readers go on with the local tier. The listing runs in a daemon thread, abandoned on
    timeout."""
    out: dict[str, Any] = {}

    def run() -> None:
        try:
            out["steps"] = remote.steps()
        except BaseException as exc:  # noqa: BLE001 - reported below
            out["error"] = exc

    t = threading.Thread(target=run, name="zerostall-list", daemon=True)
    t.start()
    t.join(timeout_s)
    if "steps" in out:
        return out["steps"], ""
    why = str(out.get("error") or f"listing {remote.url}: no answer within {timeout_s:g} s")
    log.warning("zerostall: cannot list the remote tier, going on without it: %s", why)
    return None, why


# -- shared filesystem ------------------------------------------------------------------------

class FileTier(RemoteTier):
    """A directory on a shared/parallel filesystem, written with the probed engine.

    Atomicity per file: written as ``name.part``, fdatasync'ed, renamed; the manifest last.
    """

    def __init__(self, url: str, io: IOConfig | None = None, **_: Any):
        self.url = url
        self.root = urlparse(url).path if url.startswith("file://") else url
        self.io = io or IOConfig()

    def _path(self, rel: str) -> str:
        return os.path.join(self.root, rel)

    def _err(self, action: str, rel: str, exc: OSError) -> RemoteError:
        what = os.strerror(exc.errno) if exc.errno else str(exc)
        return RemoteError(f"{action} {self.where(rel)} failed: {what}", url=self.where(rel), step=step_of(rel),
                           errno=exc.errno)

    def _engine(self) -> Any:
        from ..io import choose_engine
        return choose_engine(self.root, self.io)

    def _stream(self, src: str, sink: Callable[[int, memoryview], None]) -> int:
        """Read ``src`` with the engine through one aligned bounce buffer; returns its size."""
        from ..staging.arena import Arena
        size = os.path.getsize(src)
        eng = self._engine()
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
        eng = self._engine()
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
        try:
            self._copy(local_path, self._path(rel))
        except (OSError, ZerostallError) as exc:
            if isinstance(exc, RemoteError):
                raise
            raise RemoteError(f"copying {local_path} to {self.where(rel)} failed: {exc}", url=self.where(rel),
                              step=step_of(rel)) from exc

    def _put_bytes(self, data: bytes, rel: str) -> None:
        from .local import fsync_dir, write_file_durable
        dst = self._path(rel)
        try:
            os.makedirs(os.path.dirname(dst), exist_ok=True)
            write_file_durable(dst + ".part", data)
            os.rename(dst + ".part", dst)
            fsync_dir(os.path.dirname(dst))
        except OSError as exc:
            raise self._err("writing", rel, exc) from exc

    def checksum(self, rel: str) -> tuple[int, int]:
        """Shards (4 KiB multiples) are re-read with direct I/O, from the device or server, not
        from the page cache; small unaligned files (manifests) through the cache, then dropped."""
        crc = [0]
        path = self._path(rel)
        try:
            if os.path.getsize(path) % ALIGN_BYTES:
                size, crc[0] = file_crc32c(path)
                drop_cache(path)
                return size, crc[0]
            size = self._stream(path, lambda off, mv: crc.__setitem__(0, _crc.crc32c(mv, crc[0])))
        except OSError as exc:
            raise self._err("reading back", rel, exc) from exc
        return size, crc[0]

    def download(self, rel: str, local_path: str, size: int) -> None:
        try:
            self._copy(self._path(rel), local_path)
        except FileNotFoundError as exc:
            raise RemoteError(f"{self.where(rel)} does not exist", url=self.where(rel), step=step_of(rel),
                              errno=_errno.ENOENT) from exc
        except OSError as exc:
            raise self._err("downloading", rel, exc) from exc

    def read_bytes(self, rel: str, limit: int) -> bytes:
        try:
            with open(self._path(rel), "rb") as f:
                return f.read(limit + 1)
        except OSError as exc:
            raise self._err("reading", rel, exc) from exc

    def stat(self, rel: str) -> int | None:
        try:
            return os.stat(self._path(rel)).st_size
        except FileNotFoundError:
            return None
        except OSError as exc:
            raise self._err("stat of", rel, exc) from exc

    def steps(self) -> list[int]:
        try:
            names = os.listdir(self.root)
        except FileNotFoundError:
            return []
        except OSError as exc:
            raise self._err("listing", "", exc) from exc
        out = []
        for n in names:
            m = _STEP_RE.match(n)
            if m and os.path.isfile(os.path.join(self.root, n, MANIFEST_NAME)):
                out.append(int(m.group(1)))
        return sorted(out)

    def _delete(self, rel: str) -> None:
        try:
            os.unlink(self._path(rel))
        except FileNotFoundError:
            pass
        except OSError as exc:
            raise self._err("deleting", rel, exc) from exc

    def delete_step(self, step: int) -> None:
        self._delete(f"step-{step}/{MANIFEST_NAME}")
        shutil.rmtree(self._path(f"step-{step}"), ignore_errors=True)


# -- URLs ---------------------------------------------------------------------------------------

def is_url(path: str) -> bool:
    return "://" in str(path)
