"""``SaveHandle``: what ``Checkpointer.save()`` returns at once.

Two phases, visible in the API: ``staged()`` (the state may be mutated again) and
``durable()`` (committed and fsynced). Any thread may call any method.
"""

from __future__ import annotations

import dataclasses
import time
from typing import TYPE_CHECKING, Any

from .errors import SaveFailed
from .staging.job import SaveJob
from .telemetry.record import SaveRecord

if TYPE_CHECKING:
    from .checkpointer import Checkpointer


class SaveHandle:
    def __init__(self, job: SaveJob, owner: "Checkpointer | None" = None):
        self._job = job
        self._owner = owner

    @property
    def step(self) -> int:
        return self._job.step

    @property
    def skipped(self) -> bool:
        """True when the save was skipped by ``backpressure="skip"``; nothing is written."""
        return self._job.skipped

    def staged(self) -> bool:
        return self._job.staged.is_set()

    def durable(self) -> bool:
        return self._job.durable.is_set()

    def done(self) -> bool:
        return self._job.done.is_set()

    def replicated(self) -> bool:
        """True once the remote tier holds this checkpoint (committed there)."""
        return self._job.replicated.is_set() and self._job.replicate_error is None and self._job.error is None

    def protected(self) -> bool:
        """True once every rank's files of this step are held by ``replicas`` nodes (peer
        replicas, ``replicas > 1``); never for a step whose replication did not finish."""
        st = self._peer_status()
        return st is not None and st.protected

    def _peer_status(self) -> Any:
        peers = self._owner._peers if self._owner is not None else None
        return peers.status(self.step) if peers is not None else None

    def wait_staged(self, timeout: float | None = None) -> bool:
        """Block until the snapshot is complete (the state may then be mutated). The wait
        counts as stall in the record."""
        t0 = time.perf_counter()
        ok = self._job.staged.wait(timeout)
        self._job.guard_wait_s += time.perf_counter() - t0
        return ok

    def wait(self, timeout: float | None = None, tier: str = "local") -> bool:
        """Block until the save is committed (``tier="local"``), replicated (``"remote"``),
        its peer replication finished (``"peers"``: then see :meth:`protected`) or it has
        failed; False on timeout. Never raises for a failed save (see ``exception``)."""
        if tier == "local":
            return self._job.done.wait(timeout)
        if tier == "peers":
            if self._owner is None or self._owner._peers is None:
                raise ValueError("this Checkpointer keeps no peer copies (pass replicas=N, N > 1)")
            deadline = None if timeout is None else time.monotonic() + timeout
            if not self._job.done.wait(timeout):
                return False
            if self._job.error is not None or self._job.skipped:
                return True
            st = self._peer_status()
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            return st.done.wait(left) if st is not None else True
        if tier != "remote":
            raise ValueError(f"tier={tier!r}: choose 'local', 'peers' or 'remote'")
        if self._owner is not None and self._owner._replicator is None:
            raise ValueError("this Checkpointer has no remote tier (pass remote=URL)")
        deadline = None if timeout is None else time.monotonic() + timeout
        if not self._job.done.wait(timeout):
            return False
        if self._job.error is not None or self._job.skipped:
            return True
        left = None if deadline is None else max(0.0, deadline - time.monotonic())
        return self._job.replicated.wait(left)

    def replication_error(self) -> BaseException | None:
        return self._job.replicate_error

    def exception(self, timeout: float | None = None) -> BaseException | None:
        self._job.done.wait(timeout)
        return self._job.error

    def result(self, timeout: float | None = None) -> SaveRecord:
        """The :class:`SaveRecord`; raises :class:`SaveFailed` (cause chained) if the save failed."""
        if not self._job.done.wait(timeout):
            raise TimeoutError(f"save of step {self.step} not finished after {timeout} s")
        if self._job.error is not None:
            if self._owner is not None:
                self._owner._error_seen(self._job)
            raise SaveFailed(f"save of step {self.step} failed: {self._job.error}",
                             step=self.step) from self._job.error
        rec = record_of(self._job)
        st = self._peer_status()
        if st is not None and st.protected:
            rec = dataclasses.replace(rec, replica_nodes=st.nodes)
        return rec

    def __repr__(self) -> str:
        state = ("skipped" if self.skipped else "failed" if self._job.error else "durable"
                 if self.durable() else "staged" if self.staged() else "staging")
        return f"<SaveHandle step={self.step} {state}>"


def record_of(job: SaveJob) -> SaveRecord:
    tel = {k: v for k, v in job.telemetry.items() if k in SaveRecord.__dataclass_fields__}
    nbytes = 0 if job.skipped else job.plan.file_bytes
    return SaveRecord(
        step=job.step, bytes=nbytes, stall_s=job.save_block_s + job.guard_wait_s,
        staged_s=max(0.0, job.t_staged - job.t_submit) if job.t_staged else 0.0,
        durable_s=max(0.0, job.t_durable - job.t_submit) if job.t_durable else 0.0,
        snapshot_s=job.snapshot_s, persist_s=job.persist_s, commit_s=job.commit_s,
        persist_gbps=(nbytes / job.persist_s / 1e9) if job.persist_s > 0 else 0.0,
        engine=job.engine, arena_bytes=job.arena_bytes, skipped=job.skipped, bytes_written=nbytes,
        bytes_referenced=0 if job.skipped or job.incr is None else job.incr.bytes_referenced,
        ok=job.error is None, error=str(job.error or ""), post_commit_errors=tuple(job.post_commit_errors),
        **tel)  # type: ignore[arg-type]
