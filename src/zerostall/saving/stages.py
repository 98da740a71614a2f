"""The stages of one ``Checkpointer``'s pipeline, built once on the caller's thread.

:func:`build_stages` makes them in the order docs/design.md ("Building the stages") walks;
:func:`abandoned` releases them for a Checkpointer dropped without ``close()``.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass, replace
from typing import Any

from ..config import CheckpointConfig
from .commit import StoreCommitter
from ..distributed.node import discover
from ..distributed.session import Session, join, namespace
from ..distributed.store import Store
from ..errors import CheckpointNotFound, ConfigError
from ..io.base import Engine, engine_name_for, get_engine
from .incremental import RefTracker, mode_of
from .persist import Persister
from ..store.tier import open_tier
from .upload import Replicator
from ..store.retention import LocalRetention, RetentionPolicy, retain_at_start
from ..store import open_root
from ..store.tier import is_url
from ..restore import LoadRequest, load
from ..restore.pipeline import collective_base, collective_load
from ..telemetry import prometheus

log = logging.getLogger("zerostall")


@dataclass(frozen=True)
class Stages:
    tier: Any
    """The root: the local directory tier (the only tier a Checkpointer writes directly)."""
    rank: int
    world_size: int
    node_local: bool
    committer: StoreCommitter | None
    """None alone: the persist thread's :class:`.commit.LocalCommitter`."""
    refs: RefTracker | None
    engine: Engine
    probe: Any
    replicator: Replicator | None
    retention: LocalRetention | None
    session: Session | None = None
    """Across ranks: the start-up round's outcome (node, copies of the root)."""
    peers: Any = None
    """:class:`zerostall.peers.service.Peers` with ``replicas > 1`` (a post-commit subscriber too)."""

    @property
    def plan_rank(self) -> tuple[int, int]:
        """(rank, world size) a replicated save plans with: within this rank's copy of the root,
        so each copy holds the whole state (distributed/merge.py)."""
        s = self.session
        if s is None or not s.members or len(s.leaders) == 1:
            return self.rank, self.world_size
        return s.members.index(self.rank), len(s.members)

    def load(self, state_dict: Any, request: LoadRequest, cfg: CheckpointConfig, report: Any, *,
             engine: Engine, bounce: Any, peer: Any = None) -> Any:
        """One load (caller's thread, under the Checkpointer's save lock): across ranks the
        newest step every rank can load (:mod:`..distributed.agree`, on the committer's own store
        connection), else the newest that verifies here. ``cfg`` completes ``request``; ``peer``
        (:class:`zerostall.peers.PeerLoad`, ``replicas > 1``) counts the steps live holders keep
        for this node and fetches each before it is tried."""
        request = replace(request, verify=cfg.verify_on_load, fallback=cfg.fallback, remote=cfg.remote)
        if self.committer is None:
            return load(self.tier.root, state_dict, replace(request, rank=self.rank, world_size=self.world_size),
                        engine=engine, bounce=bounce, report=report)
        try:
            return collective_load(self.committer.store, collective_base(self.committer.session.prefix), self.rank,
                                   self.world_size, self.tier.root, state_dict, replace(request, io=cfg.io),
                                   report=report, timeout_s=max(cfg.join_timeout_s, cfg.commit_timeout_s),
                                   extra_steps=peer.steps if peer is not None else (),
                                   exclude_steps=peer.offer.split if peer is not None else (),
                                   prepare=peer.prepare if peer is not None else None, engine=engine, bounce=bounce)
        except CheckpointNotFound as exc:
            if peer is None:
                raise
            raise CheckpointNotFound(f"{exc} -- counting local roots, live peers and the remote tier (a file is "
                                     "lost when every node holding it is gone)") from None

    def persister(self, lease: Any, finished: Any) -> Persister:
        """This Checkpointer's persist worker over ``lease``'s ring, fed by the pool's snapshot
        thread, with the post-commit stages subscribed (caller's thread, once)."""
        p = Persister(self.tier, self.engine, lease.ring, finished=finished, upstream=lease.pool.snap,
                      committer=self.committer, refs=self.refs)
        for sub in (self.retention, self.replicator, self.peers):
            if sub is not None:
                p.subscribe(sub)
        return p

    def close_post_commit(self, budget_s: float) -> tuple[list[int], list[int]]:
        """Stop the post-commit stages that run threads, each bounded by ``budget_s`` (what is
        cut is finished by the next run); returns the steps not held by ``replicas`` nodes and
        those not replicated to the remote tier."""
        return (self.peers.close(budget_s) if self.peers is not None else [],
                self.replicator.close(budget_s) if self.replicator is not None else [])

    def release(self, lease: Any) -> None:
        """Once the persist thread has stopped (and the replicator is closed): the crc
        threads, the engine, the root lock, the staging lease. Rank 0 first waits (bounded) until
        every rank read the decisions of its commits: its process may host the store."""
        if self.committer is not None:
            late = self.committer.drain()
            if late:
                log.warning("zerostall: rank 0 closes before every rank acknowledged steps %s", late)
        try:
            if self.refs is not None:
                self.refs.close()
            self.engine.close()
        finally:
            self.tier.release()  # first: once the lease is gone, the root is free too
            if lease is not None:
                lease.release()  # the pool lingers a moment for the next user, then unmaps
            if self.committer is not None:
                self.committer.close()


def build_stages(path: str | os.PathLike[str], cfg: CheckpointConfig, store: Any) -> Stages:
    """Everything a Checkpointer's pipeline needs; on failure the root is released again."""
    info = discover(store, cfg.dist_mode)
    rank, world_size = info.rank, info.world_size
    if is_url(path):
        raise ConfigError(f"Checkpointer({path!r}): the root is a local directory (each node's fast disk); "
                          "pass the URL as remote= to replicate there")
    if cfg.peer_copies and world_size < 2:
        what = f"replicas={cfg.replicas}" if cfg.peers.code is None else f"peers.code={cfg.peers.code!r}"
        raise ConfigError(f"{what} needs a distributed job of several nodes "
                          "(torch.distributed, ZEROSTALL_NODE naming each node); this process saves alone")
    tier: Any = open_root(path, create=True, lock_timeout_s=cfg.lock_timeout_s, io=cfg.io)
    peers: Any = None
    committer: StoreCommitter | None = None
    try:
        session: Session | None = None
        if world_size > 1:
            if info.store is None:
                raise ConfigError(f"world size {world_size} but no c10d store: initialise torch.distributed "
                                  "first (init_process_group), pass store=, or use dist_mode='local' to save alone")
            kv = Store(info.store)  # zerostall's own connection (distributed/store.py)
            try:  # rank 0 (shared root) or each copy's leader (node-local roots) owns the root
                session = join(kv, namespace(tier.root, cfg.dist_name), rank, world_size, tier, cfg.join_timeout_s)
            except BaseException:
                kv.close()
                raise
            committer = StoreCommitter(tier, kv, session, per_rank=cfg.dist_mode == "per_rank",
                                       timeout_s=cfg.commit_timeout_s)
            node_local = session.node_local
            if cfg.peer_copies:  # after join: the store exchange runs under the session's prefix
                from ..peers.service import Peers
                peers = Peers(cfg, tier, kv, session.prefix, rank, world_size, node_local=node_local,
                              copies=session.leader_of)
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
            prometheus.enable()
        own_refs = refs.protected if refs is not None else set
        # peer replicas: the newest protected step stays local until a newer one is protected
        protect = own_refs if peers is None else (lambda: own_refs() | peers.replicator.newest_protected())
        retains = session is None or session.is_leader  # this rank applies its copy's retention
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
            tier.deferred.spare = cfg.spare_shard and not cfg.incremental  # only a full save writes over one
    except BaseException:  # a half-built Checkpointer must not keep the root locked
        if peers is not None:
            peers.close(0.0)
        tier.release()
        if committer is not None:  # its own store connection
            committer.close()
        raise
    return Stages(tier, rank, world_size, node_local, committer, refs, engine, probe, replicator, retention,
                  session, peers)


def abandoned(root: str, persist: Persister, lease: Any, stages: Stages, close_timeout_s: float) -> None:
    """Finalizer of a Checkpointer that became unreachable without ``close()`` (any thread,
    at garbage collection; never blocks): the persist thread finishes the queued saves, then
    releases what the Checkpointer held, in ``close()``'s order."""
    log.warning("zerostall: a Checkpointer of %s was dropped without close(); releasing its staging "
                "lease and root lock once its queued saves finish (call close() or use `with`)", root)

    def release() -> None:
        try:
            stages.close_post_commit(close_timeout_s)
        finally:
            stages.release(lease)
    persist.stop_then(release)
