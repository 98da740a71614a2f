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
from ..store.local import LocalTier
from .coded import CodedReplicator, check_cluster
from .coded_decode import Timeline
from .coded_restore import holdings, rebuild
from .coding import require_codec
from .exchange import Node, PeerView, advertised_host, setup
from .fetch import Offer, fetch, fetch_files, offer
from .fragments import FragmentStore, register
from .replicate import PeerReplicator, StepStatus
from . import tombstones
from .store import PeerStore, quota_for
from .tcp import Pacer, TcpTransport

__all__ = ["Peers", "StepStatus"]
log = logging.getLogger("zerostall")


class Peers:
    def __init__(self, cfg: CheckpointConfig, tier: LocalTier, store: Store, prefix: str, rank: int, world: int,
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
        built: list[tuple[TcpTransport, PeerStore]] = []  # the server's, on node leaders

        def serve(secret: bytes, me: str, nodes: list[Node]) -> tuple[str, int]:
            t, ps = self._make(secret, me, nodes, listen)
            built.append((t, ps))
            if pc.code is not None:
                register(t, FragmentStore(ps), {n.name for n in nodes}, me, pc.cpu_priority, t.recv_pacer)
            return publish, t.serve(ps)[1]

        try:
            self.view: PeerView = setup(store, prefix, rank, world, cfg.replicas, cfg.join_timeout_s, serve,
                                        copies, tombstones.read(tier.root))
            if pc.code is not None:  # every rank, not only the leaders that serve
                check_cluster(pc.data_fragments, pc.parity_fragments, [n.name for n in self.view.nodes])
        except BaseException:
            for t, _ in built:  # a half-built Peers must not keep listening
                t.close()
            raise
        self.transport, self.peer_store = built[0] if built else \
            self._make(self.view.secret, self.view.me, list(self.view.nodes), listen)  # a client only
        if self.view.leader and self.view.deleted:  # steps deleted for good on any node: their copies go here too
            mine = tombstones.read(tier.root)
            if (merged := tombstones.merge(mine, self.view.deleted)) != mine:
                tombstones.write(tier.root, merged)
            tombstones.drop_dead(tier.root, self.view.deleted)
        args = (tier, self.view, self.transport, store, self.peer_store)
        kw = dict(replicas=cfg.replicas, keep_last=cfg.keep_last, replica_timeout_s=pc.replica_timeout_s,
                  cpu_priority=pc.cpu_priority)
        self.replicator: PeerReplicator = PeerReplicator(*args, **kw) if pc.code is None else \
            CodedReplicator(*args, data_fragments=pc.data_fragments, parity_fragments=pc.parity_fragments, **kw)
        self._loads = itertools.count()
        # bench: the last restore's seconds bringing this node's files in, time.monotonic() when they
        # were committed, and its rebuild from coded fragments event by event
        self.last_fetch_s = self.last_fetch_end = 0.0
        self.last_timeline: Timeline | None = None
        self.replicator.repair()  # a replaced holder gets the kept steps back
        log.info("zerostall: peer copies on: %s across %d nodes; node %s listens on %s",
                 f"{cfg.replicas} copies of every step" if pc.code is None else
                 f"RS({pc.data_fragments},{pc.parity_fragments}) fragments of every step", len(self.view.nodes),
                 self.view.me, self.view.endpoints[self.view.me])

    def _make(self, secret: bytes, me: str, nodes: list[Node], listen: str) -> tuple[TcpTransport, PeerStore]:
        """This node's transport and peer area (served only on its leader)."""
        pc = self.cfg.peers
        recv_pacer = Pacer(pc.receive_bandwidth_bytes, pc.timeout_s) if pc.receive_bandwidth_bytes else None
        return (TcpTransport(secret, me, {n.name for n in nodes}, timeout_s=pc.timeout_s, listen_host=listen,
                             pacer=Pacer(pc.bandwidth_bytes, pc.timeout_s), listen_port=pc.listen_port,
                             cpu_priority=pc.cpu_priority, recv_pacer=recv_pacer),
                PeerStore(self.tier, me, self.engine, quota_for(self.tier.root, pc.quota_bytes, pc.quota_fraction)))

    def engine(self) -> Engine:
        """A fresh engine for one transfer (engines are used by one thread at a time)."""
        return choose_engine(self.tier.root, self.cfg.io)

    # -- persist thread ----------------------------------------------------------------
    name = "peer replicas"

    def on_committed(self, record: Any) -> None:
        """A commit subscriber: ``record`` was committed on every rank; copy it to the peers."""
        self.replicator.submit(record.step)

    # -- any thread --------------------------------------------------------------------
    def status(self, step: int) -> StepStatus | None:
        return self.replicator.status(step)

    # -- caller's thread ---------------------------------------------------------------
    def plan_load(self, step: int | None, warm: Callable[[], Any] | None = None) -> "PeerLoad":
        """``Checkpointer.load``'s first part (every rank, collectively): what this node can load
        counting live holders; the collective load then calls :meth:`PeerLoad.prepare` before each
        step it tries. ``warm`` runs on a thread of its own when this node's newest files are local."""
        n = next(self._loads)
        coded = holdings(self.view, self.transport) if self.cfg.peers.code is not None else {}
        remote_steps: list[int] = []
        if self.cfg.remote:
            remote_steps = list_steps(open_tier(self.cfg.remote, io=self.cfg.io))[0] or []
        got = offer(self.store, self.view, self.transport, self.tier, n, step=step, remote_steps=remote_steps,
                    timeout_s=self.cfg.join_timeout_s, coded=coded)
        steps = got.steps() if step is None else got.steps() & {step}
        if warm is not None and (not steps or max(steps) in got.local):
            # the nodes with their files at hand fault the load's scratch now, while a replaced
            # node fetches (its own fault would slow its fetch as much as it saved: docs/benchmarks.md)
            threading.Thread(target=warm, name="zerostall-bounce-fault", daemon=True).start()
        return PeerLoad(self, n, got, steps, coded)

    def _fetch(self, load: "PeerLoad", step: int) -> bool:
        t0 = time.perf_counter()
        timeout = self.cfg.join_timeout_s + self.cfg.peers.timeout_s * 4
        got, tl = load.offer, Timeline()
        files_in = (lambda: fetch_files(self.view, self.transport, self.tier, self.engine, step, got)) \
            if step in got.held else (lambda: rebuild(self.view, self.transport, self.tier, self.engine, step,
                                                      load.coded, got.ids.get(step, ""), timeline=tl))
        if not fetch(self.store, self.view, got, step, load.number, timeout, files_in):
            return False
        self.last_fetch_s = time.perf_counter() - t0
        self.last_fetch_end = time.monotonic()
        self.last_timeline = tl if tl.events else None
        return True

    def close(self, timeout_s: float) -> list[int]:
        return self.replicator.close(timeout_s)

    def describe(self) -> dict[str, Any]:
        return {"node": self.view.me, "nodes": [n.name for n in self.view.nodes],
                "endpoints": {k: f"{e.host}:{e.port}" for k, e in self.view.endpoints.items()}}


class PeerLoad:
    """One collective load's part of the peer tier (caller's thread of every rank): ``steps``
    (every step this node can load, locally or from live holders) and :meth:`prepare`."""

    def __init__(self, peers: Peers, number: int, got: Offer, steps: set[int], coded: Any):
        self.peers, self.number, self.offer, self.steps, self.coded = peers, number, got, steps, coded
        self.fetched: dict[int, str] = {}  # steps whose files this load brought in -> "peers" or "coded"

    def prepare(self, step: int) -> None:
        """Before the collective load loads ``step`` (every rank, in the same order): brings this
        node's files in when not local. A failed fetch raises :class:`CheckpointNotFound`, which
        the agreement reports to every rank: all fall back."""
        if self.peers._fetch(self, step):
            self.fetched[step] = "coded" if step in self.offer.coded else "peers"
