""":class:`Peers` is what the Checkpointer holds: built in ``__init__`` (caller's thread; a
collective start-up exchange through the store), fed committed steps from the persist
thread, asked for a restore plan by ``load()``, closed by ``close()``. It never touches the
training's process group. Never imported unless ``replicas > 1``.
"""

from __future__ import annotations

import itertools
import logging
import threading
import time
from typing import Any, Callable

from ..config import CheckpointConfig
from ..distributed.store import Store
from ..errors import ConfigError
from ..io.base import Engine, choose_engine
from ..store.remote import list_steps
from ..store.tier import open_tier
from ..store.tier import RootTier
from .coded import CodedReplicator, check_cluster
from .coded_restore import holdings, rebuild
from .coding import require_codec
from .exchange import PeerView, advertised_host, setup
from .fetch import Plan, agree, fetch
from .fragments import FragmentStore, register
from .placement import Node
from .replicate import PeerReplicator, StepStatus
from . import tombstones
from .store import PeerStore, quota_for
from .tcp import Pacer, TcpTransport

__all__ = ["Peers", "StepStatus"]
log = logging.getLogger("zerostall")


class Peers:
    def __init__(self, cfg: CheckpointConfig, tier: RootTier, store: Store, prefix: str, rank: int, world: int,
                 *, node_local: bool, copies: tuple[int, ...] = ()):
        pc = cfg.peers
        what = f"replicas={cfg.replicas}" if pc.code is None else \
            f"peers.code={pc.code!r} (RS({pc.data_fragments},{pc.parity_fragments}))"
        if world < 2:
            raise ConfigError(f"{what} needs a distributed job of at least {cfg.replicas} nodes "
                              "(torch.distributed with ZEROSTALL_NODE naming each node); this process saves alone")
        if cfg.dist_mode != "per_rank":
            raise ConfigError(f"{what} works with dist_mode='per_rank' only (got {cfg.dist_mode!r})")
        if not node_local:
            raise ConfigError(f"{what} needs node-local roots (each node its own {tier.root!r}); "
                              "this root is shared by every rank, so peer copies would land on the same storage")
        self.cfg, self.tier, self.store = cfg, tier, store
        if pc.code is not None:
            require_codec()  # before any exchange: every rank fails alike, with the install hint
        listen, publish = advertised_host(pc.listen_host)
        self._transport: TcpTransport | None = None
        self.peer_store: PeerStore | None = None

        def serve(secret: bytes, me: str, nodes: list[Node]) -> tuple[str, int]:
            self._transport = self._make_transport(secret, me, nodes, listen)
            self.peer_store = self._make_store(me)
            if pc.code is not None:
                register(self._transport, FragmentStore(self.peer_store), {n.name for n in nodes}, me,
                         pc.cpu_priority, self._transport.recv_pacer)
            _, port = self._transport.serve(self.peer_store)
            return publish, port

        try:
            self.view: PeerView = setup(store, prefix, rank, world, cfg.replicas, cfg.join_timeout_s, serve,
                                        copies, tombstones.read(tier.root))
            if pc.code is not None:  # every rank, not only the leaders that serve
                check_cluster(pc.data_fragments, pc.parity_fragments, [n.name for n in self.view.nodes])
        except BaseException:
            if self._transport is not None:  # a half-built Peers must not keep listening
                self._transport.close()
            raise
        if self._transport is None:  # not this node's leader: a client only
            self._transport = self._make_transport(self.view.secret, self.view.me, list(self.view.nodes), listen)
            self.peer_store = self._make_store(self.view.me)
        assert self.peer_store is not None
        if self.view.leader and self.view.deleted:  # steps deleted for good on any node: their copies go here too
            mine = tombstones.read(tier.root)
            if tombstones.merge(mine, self.view.deleted) != mine:
                tombstones.write(tier.root, tombstones.merge(mine, self.view.deleted))
            tombstones.drop_dead(tier.root, self.view.deleted)
        args = (tier, self.view, self._transport, store, self.peer_store)
        kw = dict(replicas=cfg.replicas, keep_last=cfg.keep_last, replica_timeout_s=pc.replica_timeout_s,
                  cpu_priority=pc.cpu_priority)
        self.replicator: PeerReplicator = PeerReplicator(*args, **kw) if pc.code is None else \
            CodedReplicator(*args, data_fragments=pc.data_fragments, parity_fragments=pc.parity_fragments, **kw)
        self._loads = itertools.count()
        self.planned_step = -1
        """The step the last :meth:`plan_load` agreed on (its files are local now)."""
        self.last_fetch_s = 0.0
        """Seconds the last restore spent bringing this node's files in from peers (bench)."""
        self.last_fetch_end = 0.0
        """``time.monotonic()`` when they were in, verified and committed (bench)."""
        self.replicator.repair()  # a replaced holder gets the kept steps back
        log.info("zerostall: peer copies on: %s across %d nodes; node %s listens on %s",
                 f"{cfg.replicas} copies of every step" if pc.code is None else
                 f"RS({pc.data_fragments},{pc.parity_fragments}) fragments of every step", len(self.view.nodes),
                 self.view.me, self.view.endpoints[self.view.me])

    def _make_transport(self, secret: bytes, me: str, nodes: list[Node], listen: str) -> TcpTransport:
        pc = self.cfg.peers
        return TcpTransport(secret, me, {n.name for n in nodes}, timeout_s=pc.timeout_s,
                            pacer=Pacer(pc.bandwidth_bytes, pc.timeout_s), listen_host=listen,
                            cpu_priority=pc.cpu_priority,
                            recv_pacer=Pacer(pc.receive_bandwidth_bytes, pc.timeout_s)
                            if pc.receive_bandwidth_bytes else None)

    def _make_store(self, me: str) -> PeerStore:
        pc = self.cfg.peers
        return PeerStore(self.tier, me, self.engine, quota_for(self.tier.root, pc.quota_bytes, pc.quota_fraction))

    def engine(self) -> Engine:
        """A fresh engine for one transfer (engines are used by one thread at a time)."""
        return choose_engine(self.tier.root, self.cfg.io)

    @property
    def transport(self) -> TcpTransport:
        assert self._transport is not None
        return self._transport

    # -- persist thread ----------------------------------------------------------------
    name = "peer replicas"

    def on_committed(self, record: Any) -> None:
        """A commit subscriber (:class:`~zerostall.saving.persist.CommitSubscriber`): ``record``
        (a ``Committed``) was committed on every rank; copy it to the peers."""
        self.replicator.submit(record.step)

    # -- any thread --------------------------------------------------------------------
    def status(self, step: int) -> StepStatus | None:
        return self.replicator.status(step)

    # -- caller's thread ---------------------------------------------------------------
    def plan_load(self, step: int | None, warm: Callable[[], Any] | None = None) -> tuple[int | None, str]:
        """``Checkpointer.load``'s first part with peer replicas: ``(the step to load, where this
        node's files came from)``; ``warm`` (the restore scratch's fault) runs on a thread of its
        own while this node's files are at hand."""
        remote_steps: list[int] = []
        if self.cfg.remote:
            remote_steps = list_steps(open_tier(self.cfg.remote, io=self.cfg.io))[0] or []
        plan = self.prepare_load(step, remote_steps, warm)
        self.planned_step = plan.step
        # unpinned: the collective load starts at the newest step and, if a rank's copy of it
        # fails to verify (bit rot the size check above cannot see), falls back to an older
        # one on every rank alike, instead of failing the whole job on the agreed step
        return (plan.step if step is not None else None), plan.source

    def prepare_load(self, step: int | None, remote_steps: list[int], warm: Callable[[], Any] | None = None) -> Plan:
        """Agree on the step and bring this node's files of it into the local root (peers);
        ``plan.source == "remote"``: the ordinary load must download it."""
        n = next(self._loads)
        timeout = self.cfg.join_timeout_s
        coded = holdings(self.view, self.transport) if self.cfg.peers.code is not None else {}
        plan = agree(self.store, self.view, self.transport, self.tier, n, step=step, remote_steps=remote_steps,
                     timeout_s=timeout, coded=coded)
        if plan.source not in ("peers", "coded") and warm is not None:
            # The load that follows reads through a 128 MiB scratch faulted on first use (a
            # restarted process has no faulted staging pool yet), after the ranks' agreement,
            # and the collective load waits for the slowest rank: 0.5-2.8 s of the node-loss
            # bench's load on the loaded 2-core VM. The nodes with their files at hand fault it
            # now, while a replaced node fetches; the fetching node does not (on two cores its
            # fault slowed the fetch and the agreement by as much as it saved).
            threading.Thread(target=warm, name="zerostall-bounce-fault", daemon=True).start()
        if plan.source in ("peers", "coded"):
            t0 = time.perf_counter()
            files_in = None if plan.source == "peers" else \
                (lambda: rebuild(self.view, self.transport, self.tier, self.engine, plan.step, coded,
                                 plan.checkpoint_id))
            fetch(self.store, self.view, self.transport, self.tier, self.engine, plan, n,
                  timeout + self.cfg.peers.timeout_s * 4, files_in=files_in)
            self.last_fetch_s = time.perf_counter() - t0
            self.last_fetch_end = time.monotonic()
        elif plan.source == "remote":
            log.warning("zerostall: restore of step %d: this node's files come from the remote tier "
                        "(no live node holds them)", plan.step)
        else:
            log.info("zerostall: restore of step %d: this node's files are local", plan.step)
        return plan

    def close(self, timeout_s: float) -> list[int]:
        return self.replicator.close(timeout_s)

    def describe(self) -> dict[str, Any]:
        return {"node": self.view.me, "nodes": [n.name for n in self.view.nodes],
                "endpoints": {k: f"{e.host}:{e.port}" for k, e in self.view.endpoints.items()}}
