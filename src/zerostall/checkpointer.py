"""``Checkpointer``: wires the pipeline together; holds no logic of its own stages. The walk
of one ``save()`` through them: docs/design.md ("Walking a save").

Threads: the caller's (``save``, ``guard``'s hook, ``load``, ``close``), one snapshot thread
(:mod:`.saving.snapshot`), one persist thread (:mod:`.saving.persist`) and one sampler per
save in flight. ``save()`` only plans (metadata) and enqueues.

Signal safety: ``on_preemption()``, ``wait()``, ``close()`` and the ``atexit`` hook may run in
a signal handler that interrupted ``save()`` on the same thread. They take no lock and wait on
no ``threading.Event`` (whose internal lock the interrupted frame may hold): they poll
lock-free snapshots of the in-flight list (:mod:`.saving.handle`), bounded by their timeout.
``save()`` serialises callers with ``_save_lock``, which no worker and no lifecycle method takes.
"""

from __future__ import annotations

import atexit
import contextlib
import logging
import os
import threading
import time
import weakref
from typing import Any

from .config import CheckpointConfig
from .errors import CheckpointExistsError, ConfigError, ZerostallError
from .saving.handle import InFlight, SaveHandle, step_pre_hook, wait_staged
from .memory.arena import Arena
from .memory.host import budget_bytes
from .saving.job import Job, SaveRequest, SaveStatus, Slot, Source
from .saving.plan import check_metadata, check_step
from .saving.plan_cache import PlanCache, plan_tensors
from .memory.ring import BlockRing
from .saving import pool as _pool
from .saving import snapshot as _snapshot
from .saving.snapshot import record_save_events
from .restore import LoadReport, LoadRequest
from .restore.step import shared_bounce
from .stateful import load_into, unwrap_optimizer
from .store.remote import list_steps
from .store.tier import open_tier
from .saving.stages import abandoned, build_stages
from .saving.admit import StepOrder, room_now, skip
from .telemetry.host import start_sampling_thread

log = logging.getLogger("zerostall")


class Checkpointer:
    """Asynchronous, page-cache-free checkpoints of a state dict under ``path``.

    ``Checkpointer(path, config=None, **overrides)``: ``overrides`` are fields of
    :class:`CheckpointConfig` (e.g. ``keep_last=3``). Without ``config`` the
    ``ZEROSTALL_*`` environment overrides apply.

    Under ``torch.distributed`` every rank writes its own ``rank-R.shard`` and rank 0 commits
    once all are durable, through the c10d store (``store=`` to pass another; see
    :mod:`zerostall.distributed.commit`). Every rank creates a Checkpointer on the same root (or
    ``dist_name``) within ``join_timeout_s`` and saves the same steps; ``dist_mode="local"``
    for a process that saves alone. ``oneshot=True`` (``zerostall.save``): saves stream
    through a small ring of the staging pool.
    """

    def __init__(self, path: str | os.PathLike[str], config: CheckpointConfig | None = None, *,
                 store: Any = None, oneshot: bool = False, **overrides: Any):
        cfg = config if config is not None else CheckpointConfig.from_env()
        try:
            cfg = cfg.replace(**overrides) if overrides else cfg
        except TypeError as exc:
            raise ConfigError(f"unknown Checkpointer option: {exc}") from None
        self.config, self._oneshot = cfg, oneshot
        self._stages = st = build_stages(path, cfg, store)  # on failure it released the root itself
        try:
            self._setup(st)
        except BaseException:  # a half-built Checkpointer must not keep the root locked
            st.tier.release()
            raise

    def _setup(self, st: Any) -> None:
        cfg = self.config
        self.tier, self.rank, self.world_size, self.node_local = st.tier, st.rank, st.world_size, st.node_local
        self._committer, self._refs, self.engine, self.probe = st.committer, st.refs, st.engine, st.probe
        self.session = st.session
        self._peers = st.peers  # replicas > 1: zerostall.peers.service.Peers
        self.unreplicated: list[int] = []  # after close(): the steps not replicated within close_timeout_s
        self.unprotected: list[int] = []  # after close(), replicas > 1: this run's steps not held by N nodes
        self._plans = PlanCache()
        self._order = StepOrder(self.tier, self._refs, allow_lower=cfg.allow_lower_steps)
        self._last_saved: int | None = None  # the step of the newest save queued (not skipped)
        self._save_lock = threading.Lock()  # serialises save()/load() callers; never on a lifecycle path
        self._save_owner: int | None = None
        self._saving: tuple[int, SaveStatus] | None = None  # inside save() now (close() in a handler fails it)
        self._book = InFlight(cfg)
        self._inflight = self._book.jobs
        self._closed = False
        self.records = self._book.records
        """The newest SaveRecords (bounded; the sinks in telemetry/ keep the full history)."""
        # lease the process's staging pool (no memory yet: the first save or prepare says how
        # much it wants) and start this Checkpointer's persist thread
        budget = budget_bytes(cfg.staging.budget_bytes, cfg.staging.budget_fraction)
        start_sampling_thread()  # before the pool faults (see telemetry.host.start_sampling_thread)
        self._lease = _pool.lease(0, budget, cfg.staging.block_bytes, mlock=cfg.staging.mlock,
                                  hugepages=cfg.staging.hugepages)
        self._persist = st.persister(self._lease, self._book.finished)
        # the workers never hold this Checkpointer: dropped without close(), it is released
        self._finalizer = weakref.finalize(self, abandoned, self.tier.root, self._persist, self._lease,
                                           st, cfg.close_timeout_s)
        self._finalizer.atexit = False  # at exit the atexit hook closes it properly
        self._pid = os.getpid()
        ref = weakref.ref(self)
        self._atexit = lambda: (c := ref()) is not None and c.close(_from_atexit=True)
        atexit.register(self._atexit)

    # -- the pipeline: this Checkpointer's persist thread over the process's staging pool --
    @property
    def arena(self) -> Arena:
        """The process's staging arena (shared through :mod:`.saving.pool`)."""
        return self._lease.pool.arena

    @property
    def ring(self) -> BlockRing:
        return self._lease.ring

    def _ensure_pipeline(self, file_bytes: int) -> None:
        """Ask the staging pool for what this state wants; never waits for memory (the pool
        faults in the background, grows for a larger state; the snapshot streams through)."""
        st = self.config.staging
        self._lease.want(_pool.want_bytes(file_bytes, st.block_bytes, st.slots, self._oneshot))

    def prepare(self, state_dict: Any, *, wait: bool = False) -> None:
        """Start allocating and faulting staging memory for ``state_dict`` (in the background);
        ``wait=True`` blocks until the memory is faulted (benchmarks of the steady state)."""
        self._ensure_pipeline(self._plan(state_dict).file_bytes)
        if wait:
            self._lease.pool.arena.wait_ready(self._lease.pool.target)

    def _plan(self, state_dict: Any) -> Any:
        (prank, pworld), repl = self._stages.plan_rank, self.config.dist_mode == "replicated"
        return self._plans.plan(state_dict, rank=prank, world_size=pworld, replicated=repl, early=self._ensure_pipeline)

    # -- caller's thread ----------------------------------------------------------------
    def save(self, step: int, state_dict: Any, *, overwrite: bool | None = None,
             metadata: dict[str, Any] | None = None) -> SaveHandle:
        """Start saving ``state_dict`` as ``step``; return a :class:`SaveHandle` at once.

        Do not mutate the state until ``handle.wait_staged()`` returns or an optimizer
        registered with :meth:`guard` steps (the guard waits for you). Under
        torch.distributed a save that fails here on this rank (an unsupported leaf, a pending
        background error) is reported to the other ranks, so the step fails everywhere at once.
        """
        t0 = time.perf_counter()
        if self._closed:
            raise ZerostallError("this Checkpointer is closed")
        self._book.check_process()
        step = check_step(step)  # and the metadata, leaves and manifest size in check_metadata/_plan
        me = threading.get_ident()
        if self._save_owner == me:
            raise ZerostallError("save() was re-entered on the same thread (from a signal handler that "
                                 "interrupted save()?); call on_preemption() or close() from handlers")
        with self._save_lock:
            self._save_owner = me
            try:
                return self._save(t0, step, state_dict, overwrite, metadata)
            finally:
                self._save_owner = None
                self._saving = None

    def _save(self, t0: float, step: int, state_dict: Any, overwrite: bool | None,
              metadata: dict[str, Any] | None) -> SaveHandle:
        ow = self.config.overwrite if overwrite is None else overwrite
        if step in self._book.steps():  # not reported: its round is running
            raise CheckpointExistsError(f"step {step} is already being saved")
        status, job, asked = SaveStatus(t0), None, False
        try:
            self._book.raise_pending()
            metadata = check_metadata(metadata)
            self._order.check(step, ow)
            plan = self._plan(state_dict)  # a new plan asks the pool for the tensors' bytes first (faults meanwhile)
            self._order.admitted(step)
            # an incremental save keeps one spare block for what RefTracker.settle appends
            spare = 1 if self._refs is not None else 0
            self._ensure_pipeline(plan.file_bytes + spare * self.config.staging.block_bytes)
            request = SaveRequest(step=step, plan=plan, rank=self.rank, world_size=self.world_size, overwrite=ow,
                                  user_metadata=dict(metadata or {}), engine=self.engine.name)
            nblocks = self.ring.blocks_for(plan.file_bytes) + spare
            status.interval_steps = 0 if self._last_saved is None else step - self._last_saved
            if self.config.backpressure == "skip":  # room now, on every rank (None: a rank failed or is gone)
                asked, room = True, room_now(self.ring, self._committer, step, nblocks)
                if not room:  # every rank skips this step: no round starts
                    job = Job(request, status, Slot(0, 0, None))
                    skip(job, t0, self._committer, self.rank, report=room is None)
                    self._book.finished(job)
                    return SaveHandle(job, self)
            leaves = plan_tensors(plan)
            source = Source(leaves, record_save_events(leaves) if "cuda" in plan.devices else None)
            incr = self._refs.prepare(plan) if self._refs is not None else None  # fingerprints; snapshot decides
            self._saving = (step, status)
            with self._lease.pool.reserve(nblocks, status) as slot:  # the pool lock: jobs queue in ring order
                job = Job(request, status, slot, source, incr, persist=self._persist,
                          crc_at_copy=_snapshot.CRC_AT_COPY and incr is None and plan.devices <= {"cpu"})
                self._book.add(job)
                if self._closed:  # close() ran in a handler inside save()
                    raise ZerostallError(f"the Checkpointer was closed while step {step} was being saved")
                self._lease.queue(job)
            self._last_saved = step
        except BaseException as exc:
            if status.queued:  # the workers finish it as failed; raised here, not as a background error
                status.fail(exc, in_save=True)
            else:  # never queued (the pool drained any blocks it reserved)
                if job is not None:
                    self._book.discard(job)
                if self._committer is not None:
                    self._committer.report(step, exc)  # the others' room agreement aborts on it too
                    if self.config.backpressure == "skip" and not asked:
                        self._committer.pass_room()
            raise
        status.save_block_s = time.perf_counter() - t0
        return SaveHandle(job, self)

    # -- the optimizer guard and the frameworks' adapters (caller's thread) ---------------
    def guard(self, optimizer: Any) -> Any:
        """Make ``optimizer.step()`` wait until in-flight snapshots are staged.

        Only the step, which mutates parameters and optimizer state in place, waits (and only
        if the copy is not finished). With a ``closure`` (LBFGS), the wait happens after the
        closure's forward/backward. ``optimizer`` may be a wrapper (Accelerate's, Lightning's):
        the ``torch.optim.Optimizer`` inside is guarded. Returns the hook handle (``.remove()``).
        """
        return unwrap_optimizer(optimizer).register_step_pre_hook(self.step_pre_hook)

    def step_pre_hook(self, optimizer: Any, args: Any, kwargs: Any) -> Any:
        """The optimizer step pre-hook :meth:`guard` registers (for adapters that register a
        global one): wait for the snapshots that read ``optimizer``'s tensors, or defer the
        wait into the closure so that its forward/backward still overlaps the copy."""
        return step_pre_hook(self._book.pending_staged(optimizer), args, kwargs)

    def snapshots_pending(self) -> bool:
        """True while a save's snapshot is still reading the state (lock-free)."""
        return bool(self._book.pending_staged())

    def wait_snapshots(self) -> None:
        """Wait until every in-flight snapshot is staged (counted as stall in their records)."""
        wait_staged(self._book.pending_staged())

    def inflight_steps(self) -> list[int]:
        """Steps being saved (queued, not finished), oldest first; empty when idle."""
        return self._book.steps()

    def subscribe(self, subscriber: Any) -> None:
        """Hand every step this Checkpointer commits to ``subscriber.on_committed(record)`` (a
        :class:`~.saving.job.Committed`; persist thread, in commit order, after retention and
        replication's hand-off; what it raises is recorded on the save, which stays durable)."""
        self._persist.subscribe(subscriber)

    def error_seen(self, status: SaveStatus) -> None:
        """A handle raised its save's error to the caller: not a background error any more."""
        self._book.error_seen(status)

    def wait(self, timeout: float | None = None) -> bool:
        """Block until every save started so far is committed or failed; False on timeout.
        Signal-handler safe (no lock; polls)."""
        return self._book.wait_until(None if timeout is None else time.monotonic() + timeout)

    def load(self, state_dict: Any = None, step: int | None = None, map_location: Any = None, *,
             keys: list[str] | None = None, strict: bool = False, report: Any = None) -> Any:
        """Load the newest verified checkpoint (or ``step``); see :func:`zerostall.load` (``keys``,
        ``strict``, ``report``). Under torch.distributed, collective: all ranks load the newest
        step all can load (``report.why`` says which and why). Saves started meanwhile from
        other threads wait until the load is done."""
        self._book.check_process()
        self.wait()
        peer = None
        if self._peers:
            report = report if report is not None else LoadReport()
            peer = self._peers.plan_load(step, warm=shared_bounce)
        with self._save_lock, self._lease.pool.borrow_idle() as bounce:
            request = LoadRequest(step=step, map_location=map_location, keys=keys, strict=strict)
            out = load_into(state_dict, lambda sd: self._stages.load(
                sd, request, self.config, report, engine=self.engine, bounce=bounce, peer=peer))
        if peer is not None and report.step in peer.fetched:  # peer replicas: where its files came from
            report.source = peer.fetched[report.step]
        return out

    def steps(self, *, include_remote: bool = True) -> list[int]:
        """Committed steps, ascending: local ones and, with a remote tier (unless
        ``include_remote=False``), those the remote holds (its manifest is there). A remote
        that cannot be listed within a few seconds is skipped with a warning."""
        local = self.tier.steps()
        if not include_remote or not self.config.remote:
            return local
        remote, _ = list_steps(open_tier(self.config.remote, io=self.config.io))
        return sorted(set(local) | set(remote or []))

    def latest_step(self, *, include_remote: bool = True) -> int | None:
        """The newest of :meth:`steps` (what :meth:`load` restores unless it fails to verify)."""
        steps = self.steps(include_remote=include_remote)
        return steps[-1] if steps else None

    def on_preemption(self, timeout: float | None = 60.0) -> bool:
        """Call from a SIGTERM handler: let in-flight saves finish, up to ``timeout`` seconds
        (:meth:`wait`; a save the signal interrupted before it was queued is not waited for)."""
        return self.wait(timeout)

    def close(self, timeout: float | None = None, *, _from_atexit: bool = False) -> bool:
        """Drain in-flight saves, stop the threads, free the arena; re-raises a pending error.

        With ``timeout`` (seconds; pass one from a signal handler) it returns False once the
        time is up with work still running (the threads go on as daemons; a later close()
        waits for the rest and releases). No lock without a timeout."""
        if self.__dict__.get("_released"):
            return True
        first, self._closed = not self._closed, True  # first: a save() this call interrupted fails
        if os.getpid() != self._pid:  # a forked child (at exit): the saves,
            return True  # threads and lock are the parent's; waiting for them hung the child for good
        deadline = None if timeout is None else time.monotonic() + timeout

        def left() -> float | None:
            return None if deadline is None else max(0.0, deadline - time.monotonic())
        me = threading.get_ident()  # another thread inside save(): it queues its job or gives up first
        while self._save_owner not in (None, me) and (deadline is None or time.monotonic() < deadline):
            time.sleep(0.002)
        # a save() this call interrupted after queueing its job fails (unless it is committing)
        step, saving = self._saving or (0, None)
        failed_here = first and saving is not None and saving.queued and saving.fail(
            ZerostallError(f"the Checkpointer was closed while step {step} was being saved"), in_save=True)
        ok = self._book.wait_until(deadline)
        if failed_here and saving is not None:  # its handle says so; not a background failure to re-raise here
            self._book.error_seen(saving)
        with contextlib.suppress(Exception):  # interpreter shutdown
            atexit.unregister(self._atexit)
        ok = self._persist.stop(left()) and ok  # the snapshot thread is the pool's
        budget = self.config.close_timeout_s if deadline is None else min(self.config.close_timeout_s, left() or 0.0)
        self.unprotected, self.unreplicated = self._stages.close_post_commit(budget)  # bounded; the next run goes on
        if ok:
            self._finalizer.detach()  # released here instead
            self._stages.release(self._lease)
            self._released = True
        else:
            log.warning("zerostall: close() gave up after %s s with work in flight; it goes on in daemon "
                        "threads", timeout)
        if not _from_atexit:
            self._book.raise_pending()
        return ok

    def __enter__(self) -> "Checkpointer":
        return self

    def __exit__(self, exc_type: Any, *rest: Any) -> None:
        if exc_type is None:
            self.close()
        else:  # do not mask the body's exception with a background one
            with contextlib.suppress(ZerostallError):
                self.close()
