"""Engines for fault injection at the engine seam (the only fakes in the suite)."""

import threading

from zerostall.config import IOConfig
from zerostall.io.threads import ThreadsEngine, _ThreadsFile


class FaultyEngine(ThreadsEngine):
    """A real threads engine whose write or fdatasync fails on demand, or waits on a gate."""

    name = "faulty"

    def __init__(self, cfg: IOConfig, *, fail_write: int | None = None, fail_sync: int | None = None,
                 gate: threading.Event | None = None):
        super().__init__(cfg)
        self.fail_write = fail_write  # errno for writes
        self.fail_sync = fail_sync
        self.gate = gate
        self.syncs = 0
        self.writes_started = threading.Event()

    def _wrap(self, path, fd, writable):
        eng = self

        class F(_ThreadsFile):
            def write(self, extents, overlap=None):
                eng.writes_started.set()
                if eng.gate is not None:
                    eng.gate.wait()
                if eng.fail_write is not None:
                    raise __import__("zerostall.errors").errors.storage_error(
                        "write of", path, OSError(eng.fail_write, "injected"))
                super().write(extents, overlap)

        return F(self, path, fd, writable)

    def _fdatasync(self, fd):
        self.syncs += 1
        if self.fail_sync is not None:
            raise OSError(self.fail_sync, "injected fdatasync failure")
        super()._fdatasync(fd)
