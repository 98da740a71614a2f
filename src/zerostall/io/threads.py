"""``threads`` engine: a pool of threads issuing ``pwritev``/``preadv`` on an O_DIRECT fd, for
hosts where io_uring is disabled (``os.pwritev`` releases the GIL: the pool is the queue depth).
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor, wait
from typing import Callable

from ..config import IOConfig
from .base import Engine, Extent, ShardFile, transfer


class _ThreadsFile(ShardFile):
    engine: "ThreadsEngine"

    def _run(self, reqs: list[Extent], write: bool, overlap: Callable[[], None] | None) -> None:
        futs = [self.engine.pool.submit(transfer, self.path, self.fd, off, mv, write) for off, mv in reqs]
        try:
            if overlap is not None:
                overlap()  # what it raises is raised once the requests end
        finally:
            wait(futs)  # all of them, even after an error: buffers must not be reused early
        for f in futs:
            f.result()  # the first request's error


class ThreadsEngine(Engine):
    name = "threads"
    file_type = _ThreadsFile

    def __init__(self, cfg: IOConfig):
        super().__init__(cfg)
        self.pool = ThreadPoolExecutor(max_workers=cfg.threads, thread_name_prefix="zerostall-io")

    def close(self) -> None:
        self.pool.shutdown(wait=True)
