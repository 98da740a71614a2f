"""Remote tiers: where committed checkpoints are trickled to, chosen by URL.

Every tier stores the local layout under its root (``<root>/step-N/rank-R.shard``,
``<root>/step-N/manifest.json``) and commits the object-store way: data first, the manifest
last, so a remote checkpoint exists only once complete. Called from the replicator thread
(uploads, deletes) and from ``load``/the CLI (listing, downloads).

Registry (:mod:`.tier`; fsspec-style, lazy, with install hints): ``s3://bucket/prefix`` -> :class:`S3Tier`
(boto3; ``pip install 'zerostall[s3]'``), ``file:///path`` or a plain path -> :class:`FileTier`
(a shared or parallel filesystem: Lustre, GPFS, NFS with one file per rank).
"""

from __future__ import annotations

import logging
import os
import random
import re
import shutil
import time
from abc import ABC, abstractmethod
from typing import Any, Callable
from urllib.parse import urlparse

from ..config import ALIGN_BYTES, IOConfig
from ..format.manifest import MANIFEST_NAME, MAX_MANIFEST_BYTES
from .tier import open_tier, register_tier  # noqa: F401 - the registry lives in .tier; kept importable here

log = logging.getLogger("zerostall")
_STEP_RE = re.compile(r"^step-(\d{1,19})$")


class RemoteTier(ABC):
    """One remote location. Implementations are used by one thread at a time."""

    url: str

    @abstractmethod
    def upload(self, local_path: str, rel: str) -> None:
        """Copy a local file to ``rel`` (e.g. ``step-5/rank-00000.shard``) and verify its size."""

    @abstractmethod
    def upload_bytes(self, data: bytes, rel: str) -> None: ...

    @abstractmethod
    def download(self, rel: str, local_path: str, size: int) -> None:
        """Fetch ``rel`` into ``local_path`` (created; direct I/O where the engine allows)."""

    @abstractmethod
    def read_bytes(self, rel: str, limit: int) -> bytes: ...

    @abstractmethod
    def exists(self, rel: str) -> bool: ...

    @abstractmethod
    def list_dirs(self) -> list[str]:
        """Top-level names under the root (``step-N`` candidates)."""

    @abstractmethod
    def delete_step(self, step: int) -> None:
        """Remove a step: the manifest first (uncommit), then the data."""

    def steps(self) -> list[int]:
        """Committed remote steps (a manifest exists), ascending."""
        out = []
        for n in self.list_dirs():
            m = _STEP_RE.match(n)
            if m and self.exists(f"{n}/{MANIFEST_NAME}"):
                out.append(int(m.group(1)))
        return sorted(out)

    def read_manifest_bytes(self, step: int) -> bytes:
        return self.read_bytes(f"step-{step}/{MANIFEST_NAME}", MAX_MANIFEST_BYTES)


def retry(fn: Callable[[], Any], what: str, *, attempts: int = 8, base_s: float = 0.5, cap_s: float = 30.0,
          retry_on: tuple[type[BaseException], ...] = (OSError,)) -> Any:
    """Call ``fn`` with exponential backoff and full jitter on the given errors."""
    for i in range(attempts):
        try:
            return fn()
        except retry_on as exc:
            if i == attempts - 1:
                raise
            delay = random.uniform(0, min(cap_s, base_s * 2 ** i))
            log.warning("zerostall: %s failed (%s); retry %d/%d in %.1f s", what, exc, i + 1, attempts - 1, delay)
            time.sleep(delay)
    raise AssertionError("unreachable")


# -- shared filesystem ------------------------------------------------------------------------

class FileTier(RemoteTier):
    """A directory on a shared/parallel filesystem, written with the probed engine."""

    def __init__(self, url: str, io: IOConfig | None = None, **_: Any):
        self.url = url
        self.root = urlparse(url).path if url.startswith("file://") else url
        os.makedirs(self.root, exist_ok=True)
        self.io = io or IOConfig()

    def _engine(self) -> Any:
        from ..io import choose_engine
        return choose_engine(self.root, self.io)

    def _copy(self, src: str, dst: str) -> None:
        """Aligned streaming copy through one bounce buffer (files are 4 KiB multiples)."""
        from ..staging.arena import Arena
        size = os.path.getsize(src)
        os.makedirs(os.path.dirname(dst), exist_ok=True)
        tmp = dst + ".part"
        if os.path.exists(tmp):
            os.unlink(tmp)
        eng = self._engine()
        buf = Arena(min(64 << 20, max(size, ALIGN_BYTES)), mlock=False)
        try:
            with eng.open_read(src) as r, eng.open_write(tmp, size) as w:
                for off in range(0, size, buf.nbytes):
                    n = min(buf.nbytes, size - off)
                    r.read([(off, buf.mv[:n])])
                    w.write([(off, buf.mv[:n])])
                w.finish()
        finally:
            eng.close()
            buf.close()
        os.rename(tmp, dst)

    def upload(self, local_path: str, rel: str) -> None:
        self._copy(local_path, os.path.join(self.root, rel))

    def upload_bytes(self, data: bytes, rel: str) -> None:
        from .local import fsync_dir, write_file_durable
        dst = os.path.join(self.root, rel)
        os.makedirs(os.path.dirname(dst), exist_ok=True)
        write_file_durable(dst + ".part", data)
        os.rename(dst + ".part", dst)
        fsync_dir(os.path.dirname(dst))

    def download(self, rel: str, local_path: str, size: int) -> None:
        self._copy(os.path.join(self.root, rel), local_path)

    def read_bytes(self, rel: str, limit: int) -> bytes:
        with open(os.path.join(self.root, rel), "rb") as f:
            return f.read(limit + 1)

    def exists(self, rel: str) -> bool:
        return os.path.isfile(os.path.join(self.root, rel))

    def list_dirs(self) -> list[str]:
        try:
            return os.listdir(self.root)
        except FileNotFoundError:
            return []

    def delete_step(self, step: int) -> None:
        d = os.path.join(self.root, f"step-{step}")
        try:
            os.unlink(os.path.join(d, MANIFEST_NAME))
        except FileNotFoundError:
            pass
        shutil.rmtree(d, ignore_errors=True)
