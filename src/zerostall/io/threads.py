"""``threads`` engine: a pool of threads issuing ``pwritev``/``preadv`` on an O_DIRECT fd, for
hosts where io_uring is disabled (``os.pwritev`` releases the GIL: the pool is the queue depth).
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from typing import Callable, Sequence

from ..config import IOConfig
from .base import Engine, Extent, ShardFile, split_extents, transfer


class _ThreadsFile(ShardFile):
    engine: "ThreadsEngine"

    def _run(self, extents: Sequence[Extent], write: bool, overlap: Callable[[], None] | None = None) -> None:
        reqs = split_extents(extents, self.engine.cfg.chunk_bytes)
        futs = [self.engine.pool.submit(transfer, self.path, self.fd, off, mv, write) for off, mv in reqs]
        err = None
        if overlap is not None:
            try:
                overlap()
            except BaseException as exc:  # noqa: BLE001 - re-raised after the writes end
                err = exc
        for f in futs:  # wait for all, even after an error: buffers must not be reused early
            try:
                f.result()
            except BaseException as exc:  # noqa: BLE001 - re-raised below
                err = err or exc
        if err is not None:
            raise err

    def write(self, extents: Sequence[Extent], overlap: Callable[[], None] | None = None) -> None:
        self._run(extents, True, overlap)

    def read(self, extents: Sequence[Extent]) -> None:
        self._run(extents, False)


class ThreadsEngine(Engine):
    name = "threads"

    def __init__(self, cfg: IOConfig):
        super().__init__(cfg)
        self.pool = ThreadPoolExecutor(max_workers=cfg.threads, thread_name_prefix="zerostall-io")

    def _wrap(self, path: str, fd: int, writable: bool) -> ShardFile:
        return _ThreadsFile(self, path, fd, writable)

    def close(self) -> None:
        self.pool.shutdown(wait=True)
