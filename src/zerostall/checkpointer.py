"""``Checkpointer``: wires the pipeline together; holds no logic of its own stages.

Threads: the caller's (``save``, ``guard``'s hook, ``load``, ``close``), one snapshot thread
(:mod:`.staging.snapshot`), one persist thread (:mod:`.store.persist`) and one sampler per
save in flight. ``save()`` only plans (metadata) and enqueues; the copy, write and commit
run behind it. See the README for the training-loop pattern.
"""

from __future__ import annotations

import atexit
import collections
import contextlib
import itertools
import logging
import os
import threading
import time
import weakref
from typing import Any

import torch

from .config import CheckpointConfig
from .dist.commit import StoreCommitter, setup_protocol
from .dist.ranks import discover
from .errors import CheckpointExistsError, ConfigError, SaveFailed, ZerostallError
from .handle import SaveHandle, record_of
from .io.base import Engine, engine_name_for, get_engine
from .restore import load as _load
from .staging import pool as _pool
from .staging.arena import Arena, budget_bytes
from .staging.job import SaveJob
from .staging.plan import build_plan
from .staging.ring import BlockRing
from .stateful import load_into, unwrap_optimizer
from .store.local import LocalTier
from .store.persist import Persister
from .store.remote import open_tier
from .store.replicate import Replicator
from .store.retention import RetentionPolicy
from .telemetry.host import Sampler
from .telemetry.record import emit

log = logging.getLogger("zerostall")


_instances = itertools.count()


class Checkpointer:
    """Asynchronous, page-cache-free checkpoints of a state dict under ``path``.

    ``Checkpointer(path, config=None, **overrides)``: ``overrides`` are fields of
    :class:`CheckpointConfig` (e.g. ``keep_last=3``). Without ``config`` the
    ``ZEROSTALL_*`` environment overrides apply.

    Under ``torch.distributed`` (or torchrun's environment) every rank writes its own
    ``rank-R.shard`` and rank 0 commits once all are durable, coordinating through the c10d
    store (``store=`` to pass another); see :mod:`zerostall.dist.commit`. Create
    Checkpointers in the same order on every rank, and save the same steps in the same order.
    """

    def __init__(self, path: str | os.PathLike[str], config: CheckpointConfig | None = None, *,
                 store: Any = None, **overrides: Any):
        cfg = config if config is not None else CheckpointConfig.from_env()
        if overrides:
            try:
                cfg = cfg.replace(**overrides)
            except TypeError as exc:
                raise ConfigError(f"unknown Checkpointer option: {exc}") from None
        self.config = cfg
        info = discover(store)
        self.rank, self.world_size = info.rank, info.world_size
        self.tier = LocalTier(os.fspath(path), create=True, lock_timeout_s=cfg.lock_timeout_s)
        self.tier.check_writable()
        self._committer: Any = None
        self._seq = 0
        if self.world_size > 1:
            if info.store is None:
                raise ConfigError(f"world size {self.world_size} but no c10d store: initialise torch.distributed "
                                  "first (init_process_group) or pass store=")
            prefix = f"zerostall/{next(_instances)}"
            proto = setup_protocol(info.store, prefix, self.rank, self.world_size, self.tier, cfg.commit_timeout_s)
            self._committer = StoreCommitter(self.tier, info.store, prefix, self.rank, self.world_size,
                                             per_rank=cfg.dist_mode == "per_rank", timeout_s=cfg.commit_timeout_s,
                                             node_local=proto["node_local"], leaders=proto["leaders"])
            self.node_local = proto["node_local"]
        else:  # the one writer of this root (RootLockedError if another holds it); cleans leftovers
            self.tier.own()
            self.node_local = False
        name, self.probe = engine_name_for(self.tier.root, cfg.io)
        self.engine: Engine = get_engine(name, cfg.io)
        if cfg.prometheus:
            from .telemetry import prometheus
            prometheus.enable()
        self._replicator: Replicator | None = None
        if cfg.remote:
            policy = RetentionPolicy(keep_last_local=cfg.keep_last, keep_last_remote=cfg.keep_last_remote,
                                     keep_every_remote=cfg.keep_every_remote)
            url = cfg.remote
            kwargs = dict(max_concurrency=cfg.remote_concurrency, max_bandwidth_bytes=cfg.remote_bandwidth_bytes)
            # started now: its first pass uploads what an earlier run left unreplicated
            self._replicator = Replicator(self.tier, lambda: open_tier(url, io=cfg.io, **kwargs), policy,
                                          rank=self.rank, world_size=self.world_size,
                                          local_retention=self.rank == 0 or self.node_local,
                                          retry_max_s=cfg.remote_retry_max_s)
        self.unreplicated: list[int] = []
        """After ``close()``: the steps not replicated before ``close_timeout_s`` (see README)."""
        self._lease: _pool.Lease | None = None
        self._oneshot = False  # set by zerostall.save(): stream through a small ring
        self._persist: Persister | None = None
        self._lock = threading.Lock()
        self._inflight: list[SaveJob] = []
        self._failed: list[SaveJob] = []
        self._closed = False
        self._samplers: dict[int, Sampler] = {}
        self.records: collections.deque[Any] = collections.deque(maxlen=1000)
        """The newest SaveRecords (bounded; the sinks in telemetry/ keep the full history)."""
        self._join_pool(0)  # no memory yet: the first save (or prepare) says how much it wants
        ref = weakref.ref(self)
        self._atexit = lambda: (c := ref()) is not None and c.close(_from_atexit=True)
        atexit.register(self._atexit)

    # -- the pipeline, built on the first save ------------------------------------------
    @property
    def arena(self) -> Arena | None:
        """The process's staging arena (shared through :mod:`.staging.pool`), once leased."""
        return self._lease.arena if self._lease is not None else None

    @property
    def ring(self) -> BlockRing | None:
        return self._lease.ring if self._lease is not None else None

    def _ensure_pipeline(self, file_bytes: int) -> None:
        """Join the staging pool asking for what this state wants; never waits for memory.

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
        self._lease = _pool.lease(want, budget, st.block_bytes, mlock=st.mlock, hugepages=st.hugepages)
        self._persist = Persister(self.tier, self.engine, self._lease.arena, self._lease.ring,
                                  keep_last=(self.config.keep_last if (self.rank == 0 or self.node_local)
                                             and self._replicator is None else None),
                                  on_done=self._on_done, committer=self._committer)

    def prepare(self, state_dict: Any, *, wait: bool = False) -> None:
        """Start allocating and faulting staging memory for ``state_dict``; returns at once.

        The faulting runs in a background thread without the GIL. ``wait=True`` blocks until
        the memory is faulted (for benchmarks of the steady state).
        """
        self._ensure_pipeline(self._plan(state_dict).file_bytes)
        if wait and self._lease is not None:
            self._lease.arena.wait_ready(self._lease.pool.target)

    def _plan(self, state_dict: Any) -> Any:
        return build_plan(state_dict, rank=self.rank, world_size=self.world_size,
                          replicated=self.config.dist_mode == "replicated")

    # -- caller's thread ----------------------------------------------------------------
    def save(self, step: int, state_dict: Any, *, overwrite: bool | None = None,
             metadata: dict[str, Any] | None = None) -> SaveHandle:
        """Start saving ``state_dict`` as ``step``; return a :class:`SaveHandle` at once.

        Do not mutate the state until ``handle.wait_staged()`` returns or an optimizer
        registered with :meth:`guard` steps (the guard waits for you).
        """
        t0 = time.perf_counter()
        if self._closed:
            raise ZerostallError("this Checkpointer is closed")
        self._raise_pending()
        if not isinstance(step, int) or isinstance(step, bool) or step < 0:
            raise ConfigError(f"step={step!r} is invalid: must be a non-negative int")
        ow = self.config.overwrite if overwrite is None else overwrite
        with self._lock:
            if any(j.step == step for j in self._inflight):
                raise CheckpointExistsError(f"step {step} is already being saved")
        self.tier.check_new_step(step, ow, allow_lower=self.config.allow_lower_steps)
        plan = self._plan(state_dict)
        self._ensure_pipeline(plan.file_bytes)
        assert self.ring is not None and self._lease is not None and self._persist is not None
        job = SaveJob(step=step, plan=plan, seq=self._seq, rank=self.rank, world_size=self.world_size,
                      overwrite=ow, user_metadata=dict(metadata or {}))
        self._seq += 1
        job.engine = self.engine.name
        job.arena_bytes = self.ring.capacity_bytes
        nblocks = self.ring.blocks_for(plan.file_bytes)
        if self.config.backpressure == "skip" and not self.ring.fits_now(nblocks):
            job.skipped = True
            job.save_block_s = time.perf_counter() - t0
            log.warning("zerostall: step %d skipped: earlier saves still hold the staging arena", step)
            if self._committer is not None:  # the other ranks must not wait for this rank
                self._committer.fail(job, SaveFailed(f"rank {self.rank} skipped step {step} (arena busy)", step=step))
            self._on_done(job)
            for e in (job.staged, job.durable, job.done):
                e.set()
            return SaveHandle(job, self)
        job.leaves = [leaf.tensor for leaf in plan.leaves]
        if "cuda" in plan.devices:
            job.cuda_event = torch.cuda.Event()
            job.cuda_event.record()
        job.nblocks = nblocks
        with self._lock:
            self._inflight.append(job)
            self._samplers[id(job)] = Sampler(self.config.telemetry_interval_s)
        job.t_submit = t0
        self._lease.submit(job, self._persist.submit)  # reserves blocks, then persist + snapshot
        job.save_block_s = time.perf_counter() - t0
        return SaveHandle(job, self)

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

    def _pending_staged(self) -> list[SaveJob]:
        with self._lock:
            return [j for j in self._inflight if not j.staged.is_set()]

    def _wait_staged(self, jobs: list[SaveJob]) -> None:
        for job in jobs:
            t0 = time.perf_counter()
            job.staged.wait()
            job.guard_wait_s += time.perf_counter() - t0

    def _step_pre_hook(self, opt: Any, args: Any, kwargs: Any) -> Any:
        """Optimizer step pre-hook (caller's thread): wait for staging, or defer the wait into
        the closure so that its forward/backward still overlaps the copy."""
        pending = self._pending_staged()
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
        """Block until every save so far is committed or failed."""
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._lock:
            jobs = list(self._inflight)
        for j in jobs:
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            if not j.done.wait(left):
                return False
        return True

    def load(self, state_dict: Any = None, step: int | None = None, map_location: Any = None) -> Any:
        """Load the newest verified checkpoint (or ``step``); see :func:`zerostall.load`.

        Reads through the process's staging arena when no save uses it; saves started
        meanwhile from other threads wait until the load is done.
        """
        self.wait()
        borrow = self._lease.pool.borrow_idle() if self._lease is not None else contextlib.nullcontext()
        with self._lock, borrow as bounce:
            return load_into(state_dict, lambda sd: _load(
                self.tier.root, sd, step, map_location, verify=self.config.verify_on_load,
                fallback=self.config.fallback, engine=self.engine, bounce=bounce, rank=self.rank,
                world_size=self.world_size, remote=self.config.remote))

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
        """Call from a SIGTERM handler: let in-flight saves finish (up to ``timeout``)."""
        return self.wait(timeout)

    def close(self, *, _from_atexit: bool = False) -> None:
        """Drain in-flight saves, stop the threads, free the arena; re-raises a pending error."""
        if self._closed:
            return
        self.wait()
        self._closed = True
        atexit.unregister(self._atexit)
        if self._persist is not None:
            self._persist.stop()
        if self._replicator is not None:  # bounded: the rest is uploaded by the next run
            self.unreplicated = self._replicator.close(self.config.close_timeout_s)
        self.engine.close()
        if self._lease is not None:
            self._lease.release()  # the pool lingers a moment for the next user, then unmaps
        self.tier.release()
        if not _from_atexit:
            self._raise_pending()

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
        with self._lock:
            sampler = self._samplers.pop(id(job), None)
        if sampler is not None:
            job.telemetry = sampler.stop()
        rec = record_of(job)
        self.records.append(rec)
        emit(rec, self.config.metrics_jsonl, int(job.telemetry.get("dirty_threshold_bytes", 0)))
        if self.config.prometheus:
            from .telemetry import prometheus
            prometheus.observe(rec)
        with self._lock:
            if job in self._inflight:
                self._inflight.remove(job)
            if job.error is not None and self.config.raise_on_background_error:
                self._failed.append(job)
        if self._replicator is not None and job.error is None and not job.skipped:
            self._replicator.submit(job)

    def _error_seen(self, job: SaveJob) -> None:
        with self._lock:
            if job in self._failed:
                self._failed.remove(job)

    def _raise_pending(self) -> None:
        with self._lock:
            failed, self._failed = self._failed, []
        if failed:
            job = failed[0]
            raise SaveFailed(f"an earlier background save (step {job.step}) failed: {job.error}",
                             step=job.step) from job.error
