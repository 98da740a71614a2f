"""A ``Checkpointer``'s saves once ``save()`` returned. :class:`SaveHandle`, what it returns:
two phases, ``staged()`` (the state may be mutated again) and ``durable()`` (committed and
fsynced); any thread, any method. :class:`InFlight`, the saves in flight and the records of
those that finished: ``add``/``discard`` on the caller's thread in ``save()``; ``finished`` on
the persist thread (the caller's for a skipped save); ``wait_until``, ``pending_staged`` and
``raise_pending`` on the caller's thread, possibly in a signal handler that interrupted
``save()``: so the lists change only by single atomic operations, are read from snapshots
(``tuple(...)``), and the waits poll the events (see ``Checkpointer``).
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import os
import time
from typing import Any, Callable

import torch

from ..config import CheckpointConfig
from ..errors import SaveFailed, ZerostallError
from .job import Job, SaveStatus
from ..telemetry.host import Sampler
from ..telemetry.record import SaveRecord, emit
from ..telemetry import prometheus


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
    nbytes = st.nbytes  # 0 for a skipped save (SaveStatus.skip)
    return SaveRecord(
        step=job.step, bytes=nbytes, stall_s=st.save_block_s + st.guard_wait_s,
        staged_s=max(0.0, st.t_staged - st.t_submit) if st.t_staged else 0.0,
        durable_s=max(0.0, st.t_durable - st.t_submit) if st.t_durable else 0.0,
        snapshot_s=st.snapshot_s, persist_s=st.persist_s, commit_s=st.commit_s, post_commit_s=st.post_commit_s,
        persist_gbps=(nbytes / st.persist_s / 1e9) if st.persist_s > 0 else 0.0,
        engine=job.request.engine, arena_bytes=job.slot.arena_bytes, skipped=st.skipped, bytes_written=nbytes,
        bytes_referenced=0 if job.incr is None else job.incr.bytes_referenced,  # a skipped save has none
        interval_steps=st.interval_steps,
        ok=st.error is None, error=str(st.error or ""), post_commit_errors=tuple(st.post_commit_errors),
        **tel)  # type: ignore[arg-type]


class InFlight:
    def __init__(self, config: CheckpointConfig):
        self.config = config
        self.jobs: list[Job] = []
        self._failed: list[Job] = []
        self._samplers: dict[int, Sampler] = {}
        self.records: collections.deque[SaveRecord] = collections.deque(maxlen=1000)
        self.pid = os.getpid()  # the process whose threads run these saves

    def check_process(self) -> None:
        """``save()``/``load()`` in a child forked while the Checkpointer was open: its threads,
        staging pool and root lock are the parent's (a save there never finished, a load hung)."""
        if os.getpid() != self.pid:
            raise ZerostallError(f"this Checkpointer belongs to process {self.pid}; this is a child forked from "
                                 f"it ({os.getpid()}): create a new Checkpointer (or use zerostall.load) in the child")

    # -- caller's thread ------------------------------------------------------------------
    def add(self, job: Job) -> None:
        self._samplers[id(job.status)] = Sampler(self.config.telemetry_interval_s)
        self.jobs.append(job)

    def discard(self, job: Job) -> None:
        """A save that failed in ``save()`` before it was queued: forget it."""
        sampler = self._samplers.pop(id(job.status), None)
        if sampler is not None:
            sampler.stop()
        _remove(self.jobs, job)

    def steps(self) -> list[int]:
        return [j.step for j in tuple(self.jobs)]

    # -- persist thread ---------------------------------------------------------------------
    def finished(self, job: Job) -> None:
        """Build and emit the save's record; a background failure is kept for re-raising."""
        st = job.status
        sampler = self._samplers.pop(id(st), None)
        if sampler is not None:
            st.telemetry = sampler.stop()
        rec = record_of(job)
        self.records.append(rec)
        emit(rec, self.config.metrics_jsonl, int(st.telemetry.get("dirty_threshold_bytes", 0)))
        if self.config.prometheus:
            prometheus.observe(rec)
        if st.error is not None and self.config.raise_on_background_error and not st.error_in_save:
            self._failed.append(job)
        _remove(self.jobs, job)

    # -- caller's thread, lock-free (signal handlers) ---------------------------------------
    def wait_until(self, deadline: float | None) -> bool:
        """Poll until every queued save is done; False at ``deadline`` (monotonic)."""
        # a save not queued yet belongs to a save() this thread's signal handler interrupted: skipped
        if os.getpid() != self.pid:  # a forked child: every save in flight is the parent's
            return True
        jobs = [j for j in tuple(self.jobs) if j.status.queued]
        delay = 0.0005
        for j in jobs:
            while not j.status.done.is_set():
                now = time.monotonic()
                if deadline is not None and now >= deadline:
                    return False
                time.sleep(delay if deadline is None else min(delay, deadline - now))
                delay = min(delay * 2, 0.02)
        return True

    def error_seen(self, status: SaveStatus) -> None:
        for j in tuple(self._failed):
            if j.status is status:
                _remove(self._failed, j)

    def raise_pending(self) -> None:
        """Raise the first background failure not seen yet as :class:`SaveFailed`; drops the rest."""
        failed = []
        with contextlib.suppress(IndexError):
            while True:  # lock-free drain: list.pop is atomic
                failed.append(self._failed.pop(0))
        if failed:
            job = failed[0]
            raise SaveFailed(f"an earlier background save (step {job.step}) failed: {job.status.error}",
                             step=job.step) from job.status.error

    # -- the optimizer guard (caller's thread) ------------------------------------------------
    def pending_staged(self, opt: Any = None) -> list[Job]:
        """In-flight snapshots not staged yet; with ``opt``, only those that still read its
        parameters or state."""
        pending = [j for j in tuple(self.jobs) if not j.status.staged.is_set()]
        if not pending or opt is None:
            return pending
        mine = storages_of(opt)
        return [j for j in pending if j.source.reads(mine, j.status.staged)]


def wait_staged(jobs: list[Job]) -> None:
    """Wait until ``jobs`` are staged; the wait counts as stall in their records."""
    for job in jobs:
        SaveHandle(job).wait_staged()


def step_pre_hook(pending: list[Job], args: Any, kwargs: Any) -> Any:
    """An optimizer step pre-hook's answer for ``pending`` snapshots: wait now, or defer the
    wait into the closure so that its forward/backward still overlaps the copy."""
    if not pending:
        return None
    closure = kwargs.get("closure") if kwargs else None
    where = "kwargs" if closure is not None else None
    if closure is None and len(args) > 1 and callable(args[1]):  # args[0] is the optimizer
        closure, where = args[1], "args"
    if closure is None:
        wait_staged(pending)
        return None

    def guarded_closure() -> Any:
        out = closure()
        wait_staged(pending)
        return out

    if where == "kwargs":
        return args, {**kwargs, "closure": guarded_closure}
    return (args[0], guarded_closure, *args[2:]), kwargs


def storages_of(opt: torch.optim.Optimizer) -> set[int]:
    """Addresses of the storages an optimizer step writes: its parameters and its state."""
    out = set()
    for group in opt.param_groups:
        for p in group["params"]:
            out.add(p.untyped_storage().data_ptr())
    for st in opt.state.values():
        for v in st.values():
            if isinstance(v, torch.Tensor):
                out.add(v.untyped_storage().data_ptr())
    return out


def _remove(lst: list[Any], item: Any) -> None:
    with contextlib.suppress(ValueError):
        lst.remove(item)
