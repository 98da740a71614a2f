"""The stages of one ``Checkpointer``'s pipeline, built once on the caller's thread.

:func:`build_stages` makes, in this order: the root (a ``Tier``, owned by this process or,
across ranks, by the rank the session elects), the committer (:class:`~.store.committer.
LocalCommitter` alone, :class:`~.distributed.commit.StoreCommitter` across ranks), the
incremental tracker, the I/O engine, and the post-commit stage that applies retention:
the :class:`~.store.replicate.Replicator` with a remote tier (it also applies local
retention), else :class:`~.store.retention.LocalRetention`. The Checkpointer subscribes
them to its persist thread. :func:`abandoned` releases them for a Checkpointer dropped
without ``close()``.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from typing import Any

from .config import CheckpointConfig
from .distributed.commit import StoreCommitter
from .distributed.ranks import discover
from .distributed.session import Store, join, namespace
from .errors import ConfigError
from .io.base import Engine, engine_name_for, get_engine
from .staging.incremental import RefTracker, mode_of
from .store.persist import Persister
from .store.remote import open_tier
from .store.replicate import Replicator
from .store.retention import LocalRetention, RetentionPolicy, retain_at_start
from .store.tier import is_url, open_root

log = logging.getLogger("zerostall")


@dataclass(frozen=True)
class Stages:
    tier: Any
    """The root: a ``LocalTier`` (the only tier a Checkpointer writes directly)."""
    rank: int
    world_size: int
    node_local: bool
    committer: StoreCommitter | None
    """None alone: the persist thread's :class:`~.store.committer.LocalCommitter`."""
    refs: RefTracker | None
    engine: Engine
    probe: Any
    replicator: Replicator | None
    retention: LocalRetention | None

    def persister(self, lease: Any, finished: Any) -> Persister:
        """This Checkpointer's persist worker over ``lease``'s ring, fed by the pool's snapshot
        thread, with the post-commit stages subscribed (caller's thread, once)."""
        p = Persister(self.tier, self.engine, lease.ring, finished=finished, upstream=lease.pool.snap,
                      committer=self.committer, refs=self.refs)
        for sub in (self.retention, self.replicator):
            if sub is not None:
                p.subscribe(sub)
        return p

    def release(self, lease: Any) -> None:
        """Once the persist thread has stopped (and the replicator is closed): the crc
        threads, the engine, the staging lease, the root lock."""
        try:
            if self.refs is not None:
                self.refs.close()
            self.engine.close()
        finally:
            if lease is not None:
                lease.release()  # the pool lingers a moment for the next user, then unmaps
            self.tier.release()


def build_stages(path: str | os.PathLike[str], cfg: CheckpointConfig, store: Any) -> Stages:
    """Everything a Checkpointer's pipeline needs; on failure the root is released again."""
    info = discover(store, cfg.dist_mode)
    rank, world_size = info.rank, info.world_size
    if is_url(path):
        raise ConfigError(f"Checkpointer({path!r}): the root is a local directory (each node's fast disk); "
                          "pass the URL as remote= to replicate there")
    tier: Any = open_root(path, create=True, lock_timeout_s=cfg.lock_timeout_s, io=cfg.io)
    try:
        tier.check_writable()
        committer: StoreCommitter | None = None
        if world_size > 1:
            if info.store is None:
                raise ConfigError(f"world size {world_size} but no c10d store: initialise torch.distributed "
                                  "first (init_process_group), pass store=, or use dist_mode='local' to save alone")
            # rank 0 (shared root) or each host's leader (node-local roots) owns the root
            session = join(Store(info.store), namespace(tier.root, cfg.dist_name), rank, world_size, tier,
                           cfg.join_timeout_s)
            committer = StoreCommitter(tier, Store(info.store), session,
                                       per_rank=cfg.dist_mode == "per_rank", timeout_s=cfg.commit_timeout_s)
            node_local = session.node_local
        else:  # the one writer of this root (RootLockedError if another holds it); cleans leftovers
            tier.own()
            node_local = False
        refs: RefTracker | None = None
        mode = mode_of(cfg.incremental)
        if mode is not None:  # each rank references only its own earlier files
            refs = RefTracker(mode, cfg.full_every)
            refs.seed_from(tier.steps(), tier.read_manifest, root=tier.root, rank=rank, world_size=world_size)
            if committer is not None:
                committer.refs = refs
        name, probe = engine_name_for(tier.root, cfg.io)
        engine: Engine = get_engine(name, cfg.io)
        if cfg.prometheus:
            from .telemetry import prometheus
            prometheus.enable()
        protect = refs.protected if refs is not None else set
        retains = rank == 0 or node_local  # this rank applies the root's retention
        replicator: Replicator | None = None
        retention: LocalRetention | None = None
        if cfg.remote:
            policy = RetentionPolicy(keep_last_local=cfg.keep_last, keep_last_remote=cfg.keep_last_remote,
                                     keep_every_remote=cfg.keep_every_remote)
            # built here, so a bad URL or a missing extra fails now; no network until the replicator runs
            remote = open_tier(cfg.remote, io=cfg.io, max_concurrency=cfg.remote_concurrency,
                               max_bandwidth_bytes=cfg.remote_bandwidth_bytes)
            # started now: its first pass uploads what an earlier run left unreplicated
            replicator = Replicator(tier, lambda: remote, policy, rank=rank, world_size=world_size,
                                    local_retention=retains, retry_max_s=cfg.remote_retry_max_s, protect=protect)
        elif cfg.keep_last is not None and retains:
            recent: list[int] = []
            if tier.owned:  # the owner applies keep_last now: a kill between a commit and its retention
                recent = retain_at_start(tier, cfg.keep_last, protect())  # left one too many
            retention = LocalRetention(tier, cfg.keep_last, protect=protect, recent=recent)
    except BaseException:  # a half-built Checkpointer must not keep the root locked
        tier.release()
        raise
    return Stages(tier, rank, world_size, node_local, committer, refs, engine, probe, replicator, retention)


def abandoned(root: str, persist: Persister, lease: Any, stages: Stages, close_timeout_s: float) -> None:
    """Finalizer of a Checkpointer that became unreachable without ``close()`` (any thread,
    at garbage collection; never blocks): the persist thread finishes the queued saves, then
    releases what the Checkpointer held, in ``close()``'s order."""
    log.warning("zerostall: a Checkpointer of %s was dropped without close(); releasing its staging "
                "lease and root lock once its queued saves finish (call close() or use `with`)", root)

    def release() -> None:
        try:
            if stages.replicator is not None:
                stages.replicator.close(close_timeout_s)
        finally:
            stages.release(lease)
    persist.stop_then(release)
