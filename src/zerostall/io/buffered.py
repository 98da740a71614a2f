"""``buffered`` engine: for filesystems that refuse O_DIRECT or make it meaningless.

Dirty page-cache memory stays under ``buffered_dirty_limit_bytes``: with ``RWF_DONTCACHE``
(Linux 6.14+) the kernel drops each page once written back; elsewhere every window of that
size is pushed out with ``sync_file_range`` and dropped with ``posix_fadvise(DONTNEED)``
before the next one is written. Chosen by the probe only when O_DIRECT is unavailable.
"""

from __future__ import annotations

import errno
import os
from typing import Callable, Sequence

from ..config import IOConfig
from ..errors import storage_error
from . import _sys
from .base import Engine, Extent, ShardFile, check_io_result, split_extents, transfer

_WAIT_ALL = (_sys.SYNC_FILE_RANGE_WAIT_BEFORE | _sys.SYNC_FILE_RANGE_WRITE
             | _sys.SYNC_FILE_RANGE_WAIT_AFTER)


class _BufferedFile(ShardFile):
    engine: "BufferedEngine"

    def __init__(self, engine: "BufferedEngine", path: str, fd: int, writable: bool):
        super().__init__(engine, path, fd, writable)
        self._window_start: int | None = None
        self._window_end = 0

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

    def write(self, extents: Sequence[Extent], overlap: Callable[[], None] | None = None) -> None:
        if overlap is not None:  # synchronous engine: nothing to overlap with
            overlap()
        limit = self.engine.cfg.buffered_dirty_limit_bytes
        for off, mv in split_extents(extents, self.engine.cfg.chunk_bytes):
            done = 0
            while done < len(mv):
                flags = _sys.RWF_DONTCACHE if self.engine.dontcache else 0
                try:
                    got = os.pwritev(self.fd, [mv[done:]], off + done, flags)
                except OSError as exc:
                    if flags and exc.errno in (errno.EOPNOTSUPP, errno.EINVAL):
                        self.engine.dontcache = False
                        continue
                    raise storage_error(f"write at offset {off + done} of", self.path, exc) from exc
                check_io_result(self.path, "write", off + done, len(mv) - done, got)
                done += got
            if not self.engine.dontcache:
                self._window_start = off if self._window_start is None else min(self._window_start, off)
                self._window_end = max(self._window_end, off + len(mv))
                if self._window_end - self._window_start >= limit // 2:
                    self._flush_window()

    def read(self, extents: Sequence[Extent]) -> None:
        for off, mv in split_extents(extents, self.engine.cfg.chunk_bytes):
            transfer(self.path, self.fd, off, mv, False)
            os.posix_fadvise(self.fd, off, len(mv), os.POSIX_FADV_DONTNEED)

    def finish(self) -> None:
        self._flush_window()
        super().finish()
        os.posix_fadvise(self.fd, 0, 0, os.POSIX_FADV_DONTNEED)


class BufferedEngine(Engine):
    name = "buffered"
    direct = False

    def __init__(self, cfg: IOConfig):
        super().__init__(cfg)
        self.dontcache = True  # cleared on the first EOPNOTSUPP

    def _wrap(self, path: str, fd: int, writable: bool) -> ShardFile:
        return _BufferedFile(self, path, fd, writable)
