"""What this process knows of a local root's manifests, keyed by each file's identity.

A manifest is parsed once per identity (device, inode, size, mtime, ctime; a remote tier's:
etag, size, mtime), so listing a root per save costs a stat per step and retention reads the
references of the manifest just written without re-parsing it. Any thread (one lock).
"""

from __future__ import annotations

import logging
import os
import threading
from typing import Any, Callable

from ..errors import ZerostallError

log = logging.getLogger("zerostall")


def stat_ident(path: str) -> tuple[int, ...] | None:
    """The identity of the file at ``path`` (not followed if a symlink); None if absent."""
    try:
        st = os.stat(path, follow_symlinks=False)
    except OSError:
        return None
    return (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns)


class ManifestVerdicts:
    """Per step: (identity, whether it validates, its ``ref_files`` if known)."""

    def __init__(self) -> None:
        self._mu = threading.Lock()
        self._known: dict[int, tuple[Any, bool, tuple[Any, ...] | None]] = {}

    def get(self, step: int, ident: Any) -> tuple[bool, tuple[Any, ...] | None] | None:
        """(valid, ref_files or None) recorded for ``step`` under ``ident``; None if unknown."""
        if ident is None:
            return None
        with self._mu:
            hit = self._known.get(step)
        return (hit[1], hit[2]) if hit is not None and hit[0] == ident else None

    def put(self, step: int, ident: Any, ok: bool, refs: tuple[Any, ...] | None = None) -> None:
        if ident is not None:
            with self._mu:
                self._known[step] = (ident, ok, refs)

    def valid(self, step: int, ident: Any, read: Callable[[int], Any], where: str,
              errors: tuple[type[BaseException], ...] = (ZerostallError,)) -> bool:
        """Whether ``step``'s manifest (identity ``ident``; None: absent) validates: the cached
        verdict, else ``read(step)`` (``errors`` mean invalid, logged naming ``where``)."""
        if ident is None:
            return False
        hit = self.get(step, ident)
        if hit is not None:
            return hit[0]
        refs = None
        try:
            refs = tuple(read(step).ref_files)
        except errors as exc:
            log.warning("zerostall: %s is not a loadable checkpoint (%s); load and retention ignore it", where, exc)
        self.put(step, ident, refs is not None, refs)
        return refs is not None

    def forget(self, step: int) -> None:
        with self._mu:
            self._known.pop(step, None)
