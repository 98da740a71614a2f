"""``buffered`` engine: for filesystems that refuse O_DIRECT or make it meaningless.

Dirty page-cache memory stays under ``buffered_dirty_limit_bytes``: with ``RWF_DONTCACHE``
(Linux 6.14+) the kernel drops each page once written back; elsewhere every window of that
size is pushed out with ``sync_file_range`` and dropped with ``posix_fadvise(DONTNEED)``
before the next one is written. Chosen by the probe only when O_DIRECT is unavailable.
"""

from __future__ import annotations

import errno
import os
from typing import Callable

from ..config import IOConfig
from ..errors import StorageError, storage_error
from . import _sys
from .base import Engine, Extent, ShardFile, transfer

_WAIT_ALL = (_sys.SYNC_FILE_RANGE_WAIT_BEFORE | _sys.SYNC_FILE_RANGE_WRITE
             | _sys.SYNC_FILE_RANGE_WAIT_AFTER)


class _BufferedFile(ShardFile):
    engine: "BufferedEngine"
    _window_start: int | None = None  # the dirty range not yet pushed out (set per instance)
    _window_end = 0

    def _flush_window(self) -> None:
        if self._window_start is None:
            return
        start, n = self._window_start, self._window_end - self._window_start
        try:
            _sys.sync_file_range(self.fd, start, n, _WAIT_ALL)
        except OSError as exc:
            raise storage_error("writeback of", self.path, exc) from exc
        os.posix_fadvise(self.fd, start, n, os.POSIX_FADV_DONTNEED)
        self._window_start = None

    def _run(self, reqs: list[Extent], write: bool, overlap: Callable[[], None] | None) -> None:
        if overlap is not None:  # synchronous engine: nothing to overlap with
            overlap()
        for off, mv in reqs:
            if write and self.engine.dontcache:
                try:
                    transfer(self.path, self.fd, off, mv, True, _sys.RWF_DONTCACHE)
                    continue
                except StorageError as exc:
                    if exc.errno not in (errno.EOPNOTSUPP, errno.EINVAL):
                        raise
                    self.engine.dontcache = False  # not on this kernel or filesystem
            transfer(self.path, self.fd, off, mv, write)
            if not write:
                os.posix_fadvise(self.fd, off, len(mv), os.POSIX_FADV_DONTNEED)
                continue
            self._window_start = off if self._window_start is None else min(self._window_start, off)
            self._window_end = max(self._window_end, off + len(mv))
            if self._window_end - self._window_start >= self.engine.cfg.buffered_dirty_limit_bytes // 2:
                self._flush_window()

    def finish(self) -> None:
        self._flush_window()
        super().finish()
        os.posix_fadvise(self.fd, 0, 0, os.POSIX_FADV_DONTNEED)


class BufferedEngine(Engine):
    name = "buffered"
    direct = False
    file_type = _BufferedFile

    def __init__(self, cfg: IOConfig):
        super().__init__(cfg)
        self.dontcache = True  # cleared on the first EOPNOTSUPP
