"""``Checkpointer``: wires the pipeline together; holds no logic of its own stages.

Threads: the caller's (``save``, ``guard``'s hook, ``load``, ``close``), one snapshot thread
(:mod:`.staging.snapshot`), one persist thread (:mod:`.store.persist`) and one sampler per
save in flight. ``save()`` only plans (metadata) and enqueues; the copy, write and commit
run behind it. See the README for the training-loop pattern.

Signal safety: ``on_preemption()``, ``wait()``, ``close()`` and the ``atexit`` hook may run in
a signal handler that interrupted ``save()`` (or any other method) on the same thread. They
take no lock and wait on no ``threading.Event`` (whose internal lock the interrupted frame
may hold): they read lock-free snapshots of the in-flight list and poll the jobs' flags with
a short sleep, bounded by their timeout. The worker threads never take a lock that the
caller's thread holds across more than a few bytecodes (``save()`` serialises callers with
``_save_lock``, which no worker and no lifecycle method touches).
"""

from __future__ import annotations

import atexit
import collections
import contextlib
import logging
import os
import threading
import time
import weakref
from typing import Any

import torch

from .config import CheckpointConfig
from .distributed.agree import collective_base, collective_load
from .distributed.committer import StoreCommitter
from .distributed.ranks import discover
from .distributed.session import Session, join, namespace
from .distributed.store import Store
from .errors import CheckpointExistsError, ConfigError, SaveFailed, ZerostallError
from .handle import SaveHandle, record_of
from .io.base import Engine, engine_name_for, get_engine
from .restore import load as _load
from .staging.arena import Arena, budget_bytes
from .staging.incremental import RefTracker, mode_of
from .staging.job import SaveJob
from .staging.plan import PlanCache, check_metadata, check_step
from .staging.ring import BlockRing
from .staging import pool as _pool
from .staging.snapshot import record_save_events
from .stateful import load_into, unwrap_optimizer
from .store.local import LocalTier
from .store.persist import Persister, retain_at_start
from .store.remote import open_tier
from .store.replicate import Replicator
from .store.retention import RetentionPolicy, dependents
from .telemetry.host import Sampler, start_sampling_thread
from .telemetry.record import emit

log = logging.getLogger("zerostall")


class Checkpointer:
    """Asynchronous, page-cache-free checkpoints of a state dict under ``path``.

    ``Checkpointer(path, config=None, **overrides)``: ``overrides`` are fields of
    :class:`CheckpointConfig` (e.g. ``keep_last=3``). Without ``config`` the
    ``ZEROSTALL_*`` environment overrides apply.

    Under ``torch.distributed`` (or torchrun's environment) every rank writes its own
    ``rank-R.shard`` and rank 0 commits once all are durable, coordinating through the c10d
    store (``store=`` to pass another); see :mod:`zerostall.distributed.commit`. Every rank creates
    a Checkpointer on the same root (or ``dist_name``) within ``join_timeout_s`` of each
    other and saves the same steps; ``dist_mode="local"`` for a process that saves alone.
    """

    def __init__(self, path: str | os.PathLike[str], config: CheckpointConfig | None = None, *,
                 store: Any = None, **overrides: Any):
        try:
            self._setup(path, config, store, overrides)
        except BaseException:  # a half-built Checkpointer must not keep the root locked
            tier = self.__dict__.get("tier")
            if tier is not None:
                tier.release()
            raise

    def _setup(self, path: str | os.PathLike[str], config: CheckpointConfig | None, store: Any,
               overrides: dict[str, Any]) -> None:
        cfg = config if config is not None else CheckpointConfig.from_env()
        if overrides:
            try:
                cfg = cfg.replace(**overrides)
            except TypeError as exc:
                raise ConfigError(f"unknown Checkpointer option: {exc}") from None
        self.config = cfg
        info = discover(store, cfg.dist_mode)
        self.rank, self.world_size = info.rank, info.world_size
        self.tier = LocalTier(os.fspath(path), create=True, lock_timeout_s=cfg.lock_timeout_s)
        self.tier.check_writable()
        self._committer: StoreCommitter | None = None
        self._plan_rank, self._plan_world = self.rank, self.world_size
        self.session: Session | None = None
        """The start-up round's outcome under torch.distributed (node, copies of the root)."""
        if self.world_size > 1:
            if info.store is None:
                raise ConfigError(f"world size {self.world_size} but no c10d store: initialise torch.distributed "
                                  "first (init_process_group), pass store=, or use dist_mode='local' to save alone")
            store = Store(info.store)  # zerostall's own connection (distributed/store.py)
            try:
                # rank 0 (shared root) or each copy's leader (node-local roots) owns the root
                session = join(store, namespace(self.tier.root, cfg.dist_name), self.rank, self.world_size,
                               self.tier, cfg.join_timeout_s)
            except BaseException:
                store.close()
                raise
            self.session = session
            self._committer = StoreCommitter(self.tier, store, session, per_rank=cfg.dist_mode == "per_rank",
                                             timeout_s=cfg.commit_timeout_s)
            self.node_local = session.node_local
            self._leads = session.is_leader
            if cfg.dist_mode == "replicated":  # each copy of the root holds the whole state
                self._plan_rank, self._plan_world = session.members.index(self.rank), len(session.members)
        else:  # the one writer of this root (RootLockedError if another holds it); cleans leftovers
            self.tier.own()
            self.node_local = False
            self._leads = True
        self._refs: RefTracker | None = None
        mode = mode_of(cfg.incremental)
        if mode is not None:  # each rank references only its own earlier files
            self._refs = RefTracker(mode, cfg.full_every)
            self._refs.seed_from(self.tier.steps(), self.tier.read_manifest, root=self.tier.root,
                                 rank=self.rank, world_size=self.world_size)
            if self._committer is not None:
                self._committer.refs = self._refs
        name, self.probe = engine_name_for(self.tier.root, cfg.io)
        self.engine: Engine = get_engine(name, cfg.io)
        if cfg.prometheus:
            from .telemetry import prometheus
            prometheus.enable()
        self._replicator: Replicator | None = None
        if cfg.remote:
            policy = RetentionPolicy(keep_last_local=cfg.keep_last, keep_last_remote=cfg.keep_last_remote,
                                     keep_every_remote=cfg.keep_every_remote)
            # built here, so a bad URL or a missing extra fails now; no network until the replicator runs
            remote = open_tier(cfg.remote, io=cfg.io, max_concurrency=cfg.remote_concurrency,
                               max_bandwidth_bytes=cfg.remote_bandwidth_bytes)
            # started now: its first pass uploads what an earlier run left unreplicated
            self._replicator = Replicator(self.tier, lambda: remote, policy,
                                          rank=self.rank, world_size=self.world_size,
                                          local_retention=self._leads,
                                          retry_max_s=cfg.remote_retry_max_s,
                                          protect=self._refs.protected if self._refs is not None else None)
        self._recent_commits: list[int] = []
        if cfg.keep_last is not None and self._replicator is None and self.tier.owned \
                and self._leads:
            # the owner applies keep_last now: a kill between a commit and its retention left one too many
            self._recent_commits = retain_at_start(self.tier, cfg.keep_last,
                                                   self._refs.protected() if self._refs is not None else set())
        self.unreplicated: list[int] = []
        """After ``close()``: the steps not replicated before ``close_timeout_s`` (see README)."""
        self._plans = PlanCache()
        self._step_bound: int | None = None  # owner only: no committed step is above it
        self._lease: _pool.Lease | None = None
        self._oneshot = False  # set by zerostall.save(): stream through a small ring
        self._persist: Persister | None = None
        self._save_lock = threading.Lock()  # serialises save()/load() callers; never on a lifecycle path
        self._save_owner: int | None = None
        # Mutated only with single atomic list/dict operations (append, remove, pop): read
        # lock-free by wait()/on_preemption()/close(), possibly from a signal handler.
        self._inflight: list[SaveJob] = []
        self._failed: list[SaveJob] = []
        self._closed = False
        self._samplers: dict[int, Sampler] = {}
        self.records: collections.deque[Any] = collections.deque(maxlen=1000)
        """The newest SaveRecords (bounded; the sinks in telemetry/ keep the full history)."""
        self._join_pool(0)  # no memory yet: the first save (or prepare) says how much it wants
        self._pid = os.getpid()
        ref = weakref.ref(self)
        self._atexit = lambda: (c := ref()) is not None and c.close(_from_atexit=True)
        atexit.register(self._atexit)

    # -- the pipeline: this Checkpointer's persist thread over the process's staging pool --
    @property
    def arena(self) -> Arena | None:
        """The process's staging arena (shared through :mod:`.staging.pool`)."""
        return self._lease.arena if self._lease is not None else None

    @property
    def ring(self) -> BlockRing | None:
        return self._lease.ring if self._lease is not None else None

    def _ensure_pipeline(self, file_bytes: int) -> None:
        """Ask the staging pool for what this state wants; never waits for memory.

        The pool faults the arena in the background; the snapshot thread streams through
        whatever part is ready. A larger state than before grows the pool the same way.
        """
        st = self.config.staging
        B = st.block_bytes
        blocks = -(-file_bytes // B) * B
        want = min(blocks, _pool.ONESHOT_RING_BYTES) if self._oneshot else blocks * st.slots
        if self._lease is not None:
            self._lease.want(want)
            return
        self._join_pool(want)

    def _join_pool(self, want: int) -> None:
        """Lease the process's staging pool and start this Checkpointer's persist thread."""
        st = self.config.staging
        budget = budget_bytes(st.budget_bytes, st.budget_fraction)
        start_sampling_thread()  # before the pool faults (see telemetry.host.start_sampling_thread)
        self._lease = _pool.lease(want, budget, st.block_bytes, mlock=st.mlock, hugepages=st.hugepages)
        self._persist = Persister(self.tier, self.engine, self._lease.arena, self._lease.ring,
                                  keep_last=(self.config.keep_last if self._leads
                                             and self._replicator is None else None),
                                  on_done=_weak_call(self, "_on_done"), committer=self._committer, refs=self._refs,
                                  recent=self._recent_commits)
        # The workers hold this Checkpointer only weakly: one that is dropped without close()
        # lets its persist thread finish what is queued and give back the staging lease, the
        # engine and the root lock (a lease held forever kept the pool's memory mapped).
        self._finalizer = weakref.finalize(self, _abandoned, self.tier.root, self._persist, self._lease,
                                           self.engine, self.tier, self._refs, self._replicator,
                                           self.config.close_timeout_s)
        self._finalizer.atexit = False  # at exit the atexit hook closes it properly

    def prepare(self, state_dict: Any, *, wait: bool = False) -> None:
        """Start allocating and faulting staging memory for ``state_dict``; returns at once.

        The faulting runs in a background thread without the GIL. ``wait=True`` blocks until
        the memory is faulted (for benchmarks of the steady state).
        """
        self._ensure_pipeline(self._plan(state_dict).file_bytes)
        if wait and self._lease is not None:
            self._lease.arena.wait_ready(self._lease.pool.target)

    def _plan(self, state_dict: Any) -> Any:
        return self._plans.plan(state_dict, rank=self._plan_rank, world_size=self._plan_world,
                                replicated=self.config.dist_mode == "replicated")

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

    def _save(self, t0: float, step: int, state_dict: Any, overwrite: bool | None,
              metadata: dict[str, Any] | None) -> SaveHandle:
        ow = self.config.overwrite if overwrite is None else overwrite
        if any(j.step == step for j in tuple(self._inflight)):  # not reported: its round is running
            raise CheckpointExistsError(f"step {step} is already being saved")
        job: SaveJob | None = None
        try:
            self._raise_pending()
            metadata = check_metadata(metadata)
            # Owning the root, only this writer adds steps: above every step it has seen, the
            # step-order check needs no listing (a listdir and a stat per step, per save).
            fast = self.tier.owned and self._step_bound is not None and step > self._step_bound
            self.tier.check_new_step(step, ow, allow_lower=self.config.allow_lower_steps or fast)
            if ow:
                self._check_not_referenced(step)
            plan = self._plan(state_dict)
            if self.tier.owned and (self._step_bound is None or step > self._step_bound):
                newest = self.tier.latest() if self._step_bound is None else None
                self._step_bound = max(step, newest if newest is not None else -1)
            # an incremental save keeps one spare block: tensors it referenced on speculation
            # that turn out changed are appended after its other blocks (RefTracker.settle)
            spare = 1 if self._refs is not None else 0
            self._ensure_pipeline(plan.file_bytes + spare * self.config.staging.block_bytes)
            assert self.ring is not None and self._lease is not None and self._persist is not None
            job = SaveJob(step=step, plan=plan, rank=self.rank, world_size=self.world_size,
                          overwrite=ow, user_metadata=dict(metadata or {}))  # checked by save()
            job.engine = self.engine.name
            nblocks = self.ring.blocks_for(plan.file_bytes) + spare
            if self.config.backpressure == "skip" and not self.ring.fits_now(nblocks):
                return self._skip(job, t0)
            job.leaves = [leaf.tensor for leaf in plan.leaves]
            if self._refs is not None:
                self._refs.prepare(job)  # fingerprints only; the snapshot thread decides
            if "cuda" in plan.devices:
                job.cuda_event = record_save_events(job.leaves)
            job.nblocks = nblocks
            self._samplers[id(job)] = Sampler(self.config.telemetry_interval_s)
            self._inflight.append(job)
            job.t_submit = t0
            self._lease.submit(job, self._hand_over)  # reserves job.g0.. in the shared ring, then hands over
        except BaseException as exc:
            # the pool reserves and hands over under one lock; a job it reserved blocks for but
            # could not hand over is drained by the pool itself (the shared ring moves on)
            reserved = job is not None and job.reserved and not job.pool_drained
            if job is not None and (job.to_persist or job.to_snap or reserved and not self._closed):
                # The workers finish it as failed: its reserved blocks drain (the ring moves on) and
                # the persist thread reports it; raised here, so not again as a background error.
                job.raised_in_save = True
                job.fail(exc)
                self._hand_over(job)
            else:
                if job is not None:
                    self._discard(job)
                if self._committer is not None:
                    self._committer.report(step, exc)
            raise
        job.save_block_s = time.perf_counter() - t0
        return SaveHandle(job, self)

    def _hand_over(self, job: SaveJob) -> None:
        """Queue ``job`` on both workers, each once (also called by close() for a save it interrupted)."""
        assert self._persist is not None and self._lease is not None
        if self._closed and not (job.to_persist or job.to_snap):  # close() ran in a handler inside save()
            raise ZerostallError(f"the Checkpointer was closed while step {job.step} was being saved")
        if not job.to_persist:
            job.to_persist = True
            self._persist.submit(job)
        if not job.to_snap:
            job.to_snap = True
            self._lease.pool.snap.submit(job)
        job.submitted = True

    def _discard(self, job: SaveJob) -> None:
        sampler = self._samplers.pop(id(job), None)
        if sampler is not None:
            sampler.stop()
        try:
            self._inflight.remove(job)
        except ValueError:
            pass

    def _skip(self, job: SaveJob, t0: float) -> SaveHandle:
        job.skipped = True
        job.save_block_s = time.perf_counter() - t0
        log.warning("zerostall: step %d skipped: earlier saves still hold the staging arena", job.step)
        if self._committer is not None:  # the other ranks must not wait for this rank
            self._committer.fail(job, SaveFailed(f"rank {self.rank} skipped step {job.step} (arena busy)",
                                                 step=job.step))
        self._on_done(job)
        for e in (job.staged, job.durable, job.done):
            e.set()
        return SaveHandle(job, self)

    def _check_not_referenced(self, step: int) -> None:
        """Overwriting a step that other steps borrow bytes from would break them."""
        pinned = self._refs.pinned_steps() if self._refs is not None else set()
        users = dependents(self.tier.steps(), step, self.tier.read_manifest) if os.path.isdir(
            self.tier.step_dir(step)) else []
        if users or step in pinned:
            raise CheckpointExistsError(
                f"step {step} in {self.tier.root!r} cannot be overwritten: steps "
                f"{users or 'being saved'} reference its bytes (incremental saves); pick another step")

    def guard(self, optimizer: Any) -> Any:
        """Make ``optimizer.step()`` wait until in-flight snapshots are staged.

        Forward and backward overlap the snapshot; only the step, which mutates parameters
        and optimizer state in place, waits (and only if the copy is not finished). With a
        ``closure`` (LBFGS, Lightning's automatic optimization), the wait happens after the
        closure's forward/backward, just before the update. ``optimizer`` may be a wrapper
        (Accelerate's ``AcceleratedOptimizer``, Lightning's ``LightningOptimizer``): the
        ``torch.optim.Optimizer`` inside is guarded. Returns the hook handle (``.remove()``).
        """
        return unwrap_optimizer(optimizer).register_step_pre_hook(self._step_pre_hook)

    def _pending_staged(self, opt: Any = None) -> list[SaveJob]:
        """In-flight snapshots not staged yet (lock-free); with ``opt``, only those that still
        read its parameters or state."""
        pending = [j for j in tuple(self._inflight) if not j.staged.is_set()]
        if not pending or opt is None:
            return pending
        mine = _storages_of(opt)
        return [j for j in pending if j.reads(mine)]

    def _wait_staged(self, jobs: list[SaveJob]) -> None:
        for job in jobs:
            t0 = time.perf_counter()
            job.staged.wait()
            job.guard_wait_s += time.perf_counter() - t0

    def _step_pre_hook(self, opt: Any, args: Any, kwargs: Any) -> Any:
        """Optimizer step pre-hook (caller's thread): wait for staging, or defer the wait into
        the closure so that its forward/backward still overlaps the copy."""
        pending = self._pending_staged(opt)
        if not pending:
            return None
        closure = kwargs.get("closure") if kwargs else None
        where = "kwargs" if closure is not None else None
        if closure is None and len(args) > 1 and callable(args[1]):  # args[0] is the optimizer
            closure, where = args[1], "args"
        if closure is None:
            self._wait_staged(pending)
            return None

        def guarded_closure() -> Any:
            out = closure()
            self._wait_staged(pending)
            return out

        if where == "kwargs":
            return args, {**kwargs, "closure": guarded_closure}
        return (args[0], guarded_closure, *args[2:]), kwargs

    def wait(self, timeout: float | None = None) -> bool:
        """Block until every save started so far is committed or failed; False on timeout.

        Signal-handler safe (no lock; polls), like :meth:`on_preemption` and :meth:`close`.
        """
        return self._wait_until(None if timeout is None else time.monotonic() + timeout)

    def _wait_until(self, deadline: float | None) -> bool:
        # A job not yet handed to the workers belongs to a save() that this thread's signal
        # handler interrupted: it cannot progress until the handler returns, so it is skipped.
        jobs = [j for j in tuple(self._inflight) if j.submitted]
        delay = 0.0005
        for j in jobs:
            while not j.done.is_set():
                now = time.monotonic()
                if deadline is not None and now >= deadline:
                    return False
                time.sleep(delay if deadline is None else min(delay, deadline - now))
                delay = min(delay * 2, 0.02)
        return True

    def load(self, state_dict: Any = None, step: int | None = None, map_location: Any = None, *,
             keys: list[str] | None = None, strict: bool = False, report: Any = None) -> Any:
        """Load the newest verified checkpoint (or ``step``); see :func:`zerostall.load`
        (``keys``, ``strict`` and ``report`` as there).

        Under torch.distributed this is collective: every rank calls it, and every rank loads
        the newest step that all of them can load (:mod:`zerostall.distributed.agree`;
        ``report.why`` says which and why).

        Reads through the process's staging pool when no save uses it;
        saves started meanwhile from other threads wait until the load is done.
        """
        self.wait()
        borrow = self._lease.pool.borrow_idle() if self._lease is not None else contextlib.nullcontext()
        with self._save_lock, borrow as bounce:
            if self._committer is not None and self.session is not None:  # every rank: one agreed step
                cfg, session = self.config, self.session
                return load_into(state_dict, lambda sd: collective_load(
                    self._committer.store, collective_base(session.prefix), self.rank, self.world_size,
                    self.tier.root, sd, step=step, remote=cfg.remote, io=cfg.io, report=report,
                    timeout_s=max(cfg.join_timeout_s, cfg.commit_timeout_s), map_location=map_location,
                    verify=cfg.verify_on_load, fallback=cfg.fallback, engine=self.engine, bounce=bounce,
                    keys=keys, strict=strict))
            return load_into(state_dict, lambda sd: _load(
                self.tier.root, sd, step, map_location, verify=self.config.verify_on_load,
                fallback=self.config.fallback, engine=self.engine, bounce=bounce, rank=self.rank,
                world_size=self.world_size, remote=self.config.remote, keys=keys, strict=strict, report=report))

    def steps(self, *, include_remote: bool = True) -> list[int]:
        """Committed steps, ascending: local ones and, with a remote tier (unless
        ``include_remote=False``), those the remote holds (its manifest is there). A remote
        that cannot be listed within a few seconds is skipped with a warning."""
        local = self.tier.steps()
        if not include_remote or not self.config.remote:
            return local
        from .store.remote import list_steps
        remote, _ = list_steps(open_tier(self.config.remote, io=self.config.io))
        return sorted(set(local) | set(remote or []))

    def latest_step(self, *, include_remote: bool = True) -> int | None:
        """The newest of :meth:`steps` (what :meth:`load` restores unless it fails to verify)."""
        steps = self.steps(include_remote=include_remote)
        return steps[-1] if steps else None

    def on_preemption(self, timeout: float | None = 60.0) -> bool:
        """Call from a SIGTERM handler: let in-flight saves finish, up to ``timeout`` seconds.

        Safe at any instant of ``save()`` on the same thread (takes no lock; a save that the
        signal interrupted before it was queued is not waited for). True when all finished.
        """
        return self._wait_until(None if timeout is None else time.monotonic() + timeout)

    def close(self, timeout: float | None = None, *, _from_atexit: bool = False) -> bool:
        """Drain in-flight saves, stop the threads, free the arena; re-raises a pending error.

        With ``timeout`` (seconds; pass one from a signal handler) it returns False once the
        time is up with work still running: the threads go on as daemons and the arena stays
        mapped under them. Takes no lock without a timeout.
        """
        if self._closed:
            return True
        self._closed = True  # first: a save() this call interrupted fails instead of queueing
        if os.getpid() != self.__dict__.get("_pid", os.getpid()):
            # a forked child (at its exit, the atexit hook): the saves in flight, the threads
            # and the lock are the parent's; waiting for them hung the child for good
            return True
        deadline = None if timeout is None else time.monotonic() + timeout

        def left() -> float | None:
            return None if deadline is None else max(0.0, deadline - time.monotonic())

        abandoned = []
        for job in tuple(self._inflight):
            if (job.to_persist or job.to_snap) and not job.submitted:  # interrupted between the two queues
                job.fail(ZerostallError(f"the Checkpointer was closed while step {job.step} was being saved"))
                self._hand_over(job)
                abandoned.append(job)
        ok = self._wait_until(deadline)
        for job in abandoned:  # its handle says so; not a background failure to re-raise here
            self._error_seen(job)
        try:
            atexit.unregister(self._atexit)
        except Exception:  # noqa: BLE001 - interpreter shutdown
            pass
        if self._persist is not None:  # the snapshot thread is the pool's
            ok = self._persist.stop(left()) and ok
        if self._committer is not None and ok:  # rank 0 may host the store: let every rank read its commits
            late = self._committer.drain()
            if late:
                log.warning("zerostall: rank 0 closes before every rank acknowledged steps %s", late)
        if self._replicator is not None:  # bounded: the rest is uploaded by the next run
            budget = self.config.close_timeout_s
            if deadline is not None:
                budget = min(budget, left() or 0.0)
            self.unreplicated = self._replicator.close(budget)
        if ok:
            finalizer = self.__dict__.get("_finalizer")
            if finalizer is not None:
                finalizer.detach()  # released here instead
            if self._refs is not None:
                self._refs.close()
            self.engine.close()
            if self._committer is not None:
                self._committer.close()
            if self._lease is not None:
                self._lease.release()  # the pool lingers a moment for the next user, then unmaps
            self.tier.release()
        else:
            log.warning("zerostall: close() gave up after %s s with work in flight; it goes on in daemon "
                        "threads", timeout)
        if not _from_atexit:
            self._raise_pending()
        return ok

    def __enter__(self) -> "Checkpointer":
        return self

    def __exit__(self, exc_type: Any, *rest: Any) -> None:
        if exc_type is None:
            self.close()
        else:  # do not mask the body's exception with a background one
            try:
                self.close()
            except ZerostallError:
                pass

    # -- persist thread -----------------------------------------------------------------
    def _on_done(self, job: SaveJob) -> None:
        sampler = self._samplers.pop(id(job), None)
        if sampler is not None:
            job.telemetry = sampler.stop()
        rec = record_of(job)
        self.records.append(rec)
        emit(rec, self.config.metrics_jsonl, int(job.telemetry.get("dirty_threshold_bytes", 0)))
        if self.config.prometheus:
            from .telemetry import prometheus
            prometheus.observe(rec)
        if job.error is not None and self.config.raise_on_background_error and not job.raised_in_save:
            self._failed.append(job)
        try:
            self._inflight.remove(job)
        except ValueError:
            pass
        if self._replicator is not None and job.error is None and not job.skipped:
            self._replicator.submit(job)

    def _error_seen(self, job: SaveJob) -> None:
        try:
            self._failed.remove(job)
        except ValueError:
            pass

    def _raise_pending(self) -> None:
        failed = []
        while True:  # lock-free drain: list.pop is atomic
            try:
                failed.append(self._failed.pop(0))
            except IndexError:
                break
        if failed:
            job = failed[0]
            raise SaveFailed(f"an earlier background save (step {job.step}) failed: {job.error}",
                             step=job.step) from job.error


def _weak_call(obj: Any, name: str) -> Any:
    """``obj.<name>`` through a weak reference: a no-op once ``obj`` is gone."""
    ref = weakref.ref(obj)

    def call(*args: Any) -> Any:
        o = ref()
        return None if o is None else getattr(o, name)(*args)
    return call


def _abandoned(root: str, persist: Persister, lease: Any, engine: Engine, tier: LocalTier,
               refs: RefTracker | None, replicator: Replicator | None, close_timeout_s: float) -> None:
    """Finalizer of a Checkpointer that became unreachable without ``close()`` (any thread,
    at garbage collection; never blocks): the persist thread finishes the queued saves, then
    releases what the Checkpointer held, in ``close()``'s order."""
    log.warning("zerostall: a Checkpointer of %s was dropped without close(); releasing its staging "
                "lease and root lock once its queued saves finish (call close() or use `with`)", root)

    def release() -> None:
        try:
            if replicator is not None:
                replicator.close(close_timeout_s)
            if refs is not None:
                refs.close()
            engine.close()
        finally:
            tier.release()
            lease.release()
    persist.stop_then(release)


def _storages_of(opt: torch.optim.Optimizer) -> set[int]:
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
