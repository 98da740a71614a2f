"""``SaveHandle``: what ``Checkpointer.save()`` returns at once. Two phases: ``staged()`` (the
state may be mutated again) and ``durable()`` (committed and fsynced). Any thread, any method.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Any, Callable

from ..errors import SaveFailed
from .job import Job
from ..telemetry.record import SaveRecord


class SaveHandle:
    """Reads the save's :class:`~.job.SaveStatus` (any thread); ``wait_staged`` adds its wait to the stall.
    ``owner``: the ``Checkpointer`` that made it (its ``_peers``, ``config.remote`` and ``error_seen``)."""

    def __init__(self, job: Job, owner: Any = None):
        self._job = job
        self._status = job.status
        self._owner = owner

    @property
    def step(self) -> int:
        return self._job.step

    @property
    def skipped(self) -> bool:
        """True when the save was skipped by ``backpressure="skip"``; nothing is written."""
        return self._status.skipped

    def staged(self) -> bool:
        return self._status.staged.is_set()

    def durable(self) -> bool:
        return self._status.durable.is_set()

    def done(self) -> bool:
        return self._status.done.is_set()

    def replicated(self) -> bool:
        """True once the remote tier holds this checkpoint (committed there)."""
        st = self._status
        return st.replicated.is_set() and st.replicate_error is None and st.error is None

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
        ok = self._status.staged.wait(timeout)
        self._status.add_guard_wait(time.perf_counter() - t0)
        return ok

    def wait(self, timeout: float | None = None, tier: str = "local") -> bool:
        """Block until the save is committed (``tier="local"``), replicated (``"remote"``),
        its peer replication finished (``"peers"``: then see :meth:`protected`) or it has
        failed; False on timeout. Never raises for a failed save (see ``exception``)."""
        st = self._status
        if tier == "local":
            return st.done.wait(timeout)
        if tier == "peers":
            if self._owner is None or self._owner._peers is None:
                raise ValueError("this Checkpointer keeps no peer copies (pass replicas=N, N > 1)")
            then: Callable[[float | None], bool] = \
                lambda left: (ps := self._peer_status()) is None or ps.done.wait(left)
        elif tier == "remote":
            if self._owner is not None and not self._owner.config.remote:
                raise ValueError("this Checkpointer has no remote tier (pass remote=URL)")
            then = st.replicated.wait
        else:
            raise ValueError(f"tier={tier!r}: choose 'local', 'peers' or 'remote'")
        deadline = None if timeout is None else time.monotonic() + timeout
        if not st.done.wait(timeout):
            return False
        if st.error is not None or st.skipped:  # nothing goes beyond the local tier
            return True
        return then(None if deadline is None else max(0.0, deadline - time.monotonic()))

    def replication_error(self) -> BaseException | None:
        """Why the remote tier does not hold this step (yet), or None."""
        return self._status.replicate_error

    def exception(self, timeout: float | None = None) -> BaseException | None:
        self._status.done.wait(timeout)
        return self._status.error

    def result(self, timeout: float | None = None) -> SaveRecord:
        """The :class:`SaveRecord`; raises :class:`SaveFailed` (cause chained) if the save failed."""
        st = self._status
        if not st.done.wait(timeout):
            raise TimeoutError(f"save of step {self.step} not finished after {timeout} s")
        if st.error is not None:
            if self._owner is not None:
                self._owner.error_seen(st)
            raise SaveFailed(f"save of step {self.step} failed: {st.error}", step=self.step) from st.error
        rec = record_of(self._job)
        ps = self._peer_status()
        if ps is not None and ps.protected:
            rec = dataclasses.replace(rec, replica_nodes=ps.nodes)
        return rec

    def __repr__(self) -> str:
        state = ("skipped" if self.skipped else "failed" if self._status.error else "durable"
                 if self.durable() else "staged" if self.staged() else "staging")
        return f"<SaveHandle step={self.step} {state}>"


def record_of(job: Job) -> SaveRecord:
    st = job.status
    tel = {k: v for k, v in st.telemetry.items() if k in SaveRecord.__dataclass_fields__}
    nbytes = 0 if st.skipped else st.nbytes
    return SaveRecord(
        step=job.step, bytes=nbytes, stall_s=st.save_block_s + st.guard_wait_s,
        staged_s=max(0.0, st.t_staged - st.t_submit) if st.t_staged else 0.0,
        durable_s=max(0.0, st.t_durable - st.t_submit) if st.t_durable else 0.0,
        snapshot_s=st.snapshot_s, persist_s=st.persist_s, commit_s=st.commit_s, post_commit_s=st.post_commit_s,
        persist_gbps=(nbytes / st.persist_s / 1e9) if st.persist_s > 0 else 0.0,
        engine=job.request.engine, arena_bytes=job.slot.arena_bytes, skipped=st.skipped, bytes_written=nbytes,
        bytes_referenced=0 if st.skipped or job.incr is None else job.incr.bytes_referenced,
        interval_steps=st.interval_steps,
        ok=st.error is None, error=str(st.error or ""), post_commit_errors=tuple(st.post_commit_errors),
        **tel)  # type: ignore[arg-type]
