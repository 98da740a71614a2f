"""The replicator thread: trickles committed checkpoints to the remote tier, then applies
retention on both tiers.

One daemon thread per ``Checkpointer`` (started only with a remote tier), fed by the
persist thread after each local commit. It runs at idle I/O priority (``ioprio_set``
IOPRIO_CLASS_IDLE, inherited by the upload threads it creates) under a bandwidth cap, so
it never competes with the next local save. Each rank uploads its own shard; rank 0 uploads
the manifest last, once every rank's shard is there, so a remote checkpoint exists only when
complete. A failed replication is retried with exponential backoff and jitter for
``timeout_s``; the local copy is kept until the remote one is committed.
"""

from __future__ import annotations

import ctypes
import logging
import os
import random
import time
from typing import Any, Callable

from .._util import Worker
from ..format.layout import shard_name
from ..format.manifest import MANIFEST_NAME
from ..staging.job import SaveJob
from .local import LocalTier
from .retention import RetentionPolicy

log = logging.getLogger("zerostall")
_SYS_ioprio_set = 251
_IOPRIO_CLASS_IDLE = 3


def set_idle_io_priority() -> bool:
    """IOPRIO_CLASS_IDLE for the calling thread (and threads it creates later)."""
    libc = ctypes.CDLL(None, use_errno=True)
    return libc.syscall(_SYS_ioprio_set, 1, 0, _IOPRIO_CLASS_IDLE << 13) == 0


class Replicator(Worker[SaveJob]):
    def __init__(self, tier: LocalTier, make_remote: Callable[[], Any], policy: RetentionPolicy, *,
                 rank: int = 0, world_size: int = 1, timeout_s: float = 3600.0,
                 on_done: Callable[[SaveJob], None] | None = None):
        self.tier = tier
        self.make_remote = make_remote
        self.policy = policy
        self.rank, self.world_size = rank, world_size
        self.timeout_s = timeout_s
        self.on_done = on_done
        self.replicated: set[int] = set()
        self._remote: Any = None
        super().__init__("zerostall-replicate")

    # -- replicator thread ------------------------------------------------------------------
    def on_start(self) -> None:
        set_idle_io_priority()

    def handle(self, job: SaveJob) -> None:
        self._replicate(job)

    def _remote_tier(self) -> Any:
        if self._remote is None:
            self._remote = self.make_remote()
            if hasattr(self._remote, "ensure_bucket"):
                self._remote.ensure_bucket()
        return self._remote

    def _once(self, job: SaveJob) -> None:
        remote = self._remote_tier()
        d = self.tier.step_dir(job.step)
        rel = f"step-{job.step}"
        remote.upload(os.path.join(d, job.file_name), f"{rel}/{job.file_name}")
        if self.rank == 0:
            names = [shard_name(r) for r in range(self.world_size)]
            deadline = time.monotonic() + self.timeout_s
            while not all(remote.exists(f"{rel}/{n}") for n in names):
                if time.monotonic() > deadline:
                    raise TimeoutError(f"step {job.step}: not every rank uploaded its shard within {self.timeout_s:g} s")
                time.sleep(0.5)
            with open(os.path.join(d, MANIFEST_NAME), "rb") as f:
                remote.upload_bytes(f.read(), f"{rel}/{MANIFEST_NAME}")  # last: the remote commit

    def _replicate(self, job: SaveJob) -> None:
        t0 = time.monotonic()
        attempt = 0
        while True:
            try:
                self._once(job)
                break
            except Exception as exc:  # noqa: BLE001 - retried, then reported on the handle
                attempt += 1
                if time.monotonic() - t0 > self.timeout_s:
                    job.replicate_error = exc
                    log.error("zerostall: replication of step %d failed for good (the local copy is kept): %s",
                              job.step, exc)
                    job.replicated.set()
                    return
                delay = random.uniform(0, min(30.0, 0.5 * 2 ** min(attempt, 6)))
                log.warning("zerostall: replication of step %d failed (%s); retrying in %.1f s", job.step, exc, delay)
                self._remote = None  # reconnect
                time.sleep(delay)
        job.t_replicated = time.perf_counter()
        self.replicated.add(job.step)
        job.replicated.set()
        log.info("zerostall: step %d replicated to %s", job.step, self._remote_tier().url)
        self._retain()

    def _retain(self) -> None:
        try:
            for s in self.policy.local_doomed(self.tier.steps(), self.replicated):
                self.tier.delete(s)
            if self.rank == 0:
                remote = self._remote_tier()
                for s in self.policy.remote_doomed(remote.steps()):
                    remote.delete_step(s)
                    log.info("zerostall: retention removed step %d from %s", s, remote.url)
        except Exception as exc:  # noqa: BLE001 - retention must not stop replication
            log.warning("zerostall: retention failed: %s", exc)
