"""``Checkpointer``: wires the pipeline together; holds no logic of its own stages.

Threads: the caller's (``save``, ``guard``'s hook, ``load``, ``close``), one snapshot thread
(:mod:`.staging.snapshot`), one persist thread (:mod:`.store.persist`) and one sampler per
save in flight. ``save()`` only plans (metadata) and enqueues; the copy, write and commit
run behind it. See the README for the training-loop pattern.
"""

from __future__ import annotations

import atexit
import collections
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
from .staging.arena import Arena, budget_bytes
from .staging.incremental import RefTracker, mode_of
from .staging.job import SaveJob
from .staging.plan import build_plan, check_metadata, check_step
from .staging.ring import BlockRing
from .staging.snapshot import Snapshotter
from .stateful import load_into, unwrap_optimizer
from .store.local import LocalTier
from .store.persist import Persister
from .store.remote import open_tier
from .store.replicate import Replicator
from .store.retention import RetentionPolicy, dependents
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
        self._refs: RefTracker | None = None
        mode = mode_of(cfg.incremental)
        if mode is not None:
            if self.world_size > 1:
                raise ConfigError(f"incremental={cfg.incremental!r} supports single-process saves only (this is "
                                  f"world size {self.world_size}); pass incremental=False")
            self._refs = RefTracker(mode, cfg.full_every)
            self._refs.seed_from(self.tier.steps(), self.tier.read_manifest)
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
                                          retry_max_s=cfg.remote_retry_max_s,
                                          protect=self._refs.protected if self._refs is not None else None)
        self.unreplicated: list[int] = []
        """After ``close()``: the steps not replicated before ``close_timeout_s`` (see README)."""
        self.arena: Arena | None = None
        self.ring: BlockRing | None = None
        self._snap: Snapshotter | None = None
        self._persist: Persister | None = None
        self._lock = threading.Lock()
        self._inflight: list[SaveJob] = []
        self._failed: list[SaveJob] = []
        self._closed = False
        self._samplers: dict[int, Sampler] = {}
        self.records: collections.deque[Any] = collections.deque(maxlen=1000)
        """The newest SaveRecords (bounded; the sinks in telemetry/ keep the full history)."""
        ref = weakref.ref(self)
        self._atexit = lambda: (c := ref()) is not None and c.close(_from_atexit=True)
        atexit.register(self._atexit)

    # -- the pipeline, built on the first save ------------------------------------------
    def _ensure_pipeline(self, file_bytes: int) -> None:
        if self.arena is not None:
            return
        st = self.config.staging
        budget = budget_bytes(st.budget_bytes, st.budget_fraction)
        B = st.block_bytes
        want = -(-file_bytes // B) * B * st.slots
        size = max(2 * B, min(budget // B * B, want))
        if size < want:
            log.info("zerostall: state (%d MiB) x %d slots exceeds the staging budget (%d MiB): "
                     "snapshots stream through a %d MiB ring", file_bytes >> 20, st.slots,
                     budget >> 20, size >> 20)
        self.arena = Arena(size, mlock=st.mlock, hugepages=st.hugepages)
        self.ring = BlockRing(self.arena.nbytes, B)
        self._persist = Persister(self.tier, self.engine, self.arena, self.ring,
                                  keep_last=(self.config.keep_last if (self.rank == 0 or self.node_local)
                                             and self._replicator is None else None),
                                  on_done=self._on_done, committer=self._committer, refs=self._refs)
        self._snap = Snapshotter(self.arena, self.ring)

    def prepare(self, state_dict: Any) -> None:
        """Allocate and pre-fault the arena for ``state_dict`` now, not in the first save."""
        self._ensure_pipeline(self._plan(state_dict).file_bytes)

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
        step = check_step(step)  # and the metadata, leaves and manifest size in check_metadata/_plan
        user_metadata = check_metadata(metadata)
        ow = self.config.overwrite if overwrite is None else overwrite
        with self._lock:
            if any(j.step == step for j in self._inflight):
                raise CheckpointExistsError(f"step {step} is already being saved")
        self.tier.check_new_step(step, ow, allow_lower=self.config.allow_lower_steps)
        if ow:
            self._check_not_referenced(step)
        plan = self._plan(state_dict)
        self._ensure_pipeline(plan.file_bytes)
        assert self.ring is not None and self._snap is not None and self._persist is not None
        job = SaveJob(step=step, plan=plan, seq=self._seq, rank=self.rank, world_size=self.world_size,
                      overwrite=ow, user_metadata=user_metadata)
        self._seq += 1
        job.engine = self.engine.name
        job.arena_bytes = self.arena.nbytes if self.arena else 0
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
        if self._refs is not None:
            self._refs.prepare(job)  # fingerprints only; the snapshot thread decides
        if "cuda" in plan.devices:
            job.cuda_event = torch.cuda.Event()
            job.cuda_event.record()
        job.nblocks = nblocks
        with self._lock:
            self._inflight.append(job)
            self._samplers[id(job)] = Sampler(self.config.telemetry_interval_s)
        job.g0 = self.ring.reserve(nblocks)
        job.t_submit = t0
        self._persist.submit(job)
        self._snap.submit(job)
        job.save_block_s = time.perf_counter() - t0
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

        Reads through this checkpointer's (pre-faulted) arena when no save is in flight;
        saves started meanwhile from other threads wait until the load is done.
        """
        self.wait()
        with self._lock:
            bounce = self.arena if self.arena is not None and not self._inflight else None
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
        if self._snap is not None:
            self._snap.stop()
        if self._persist is not None:
            self._persist.stop()
        if self._refs is not None:
            self._refs.close()
        if self._replicator is not None:  # bounded: the rest is uploaded by the next run
            self.unreplicated = self._replicator.close(self.config.close_timeout_s)
        self.engine.close()
        if self.arena is not None:
            self.arena.close()
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
