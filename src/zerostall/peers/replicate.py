"""The post-commit stage that copies each committed step to peers, and tells every rank when
the step is protected (held by ``replicas`` nodes). Per step (``submit``, persist thread):

1. on each node's leader, the *sender* thread (at :func:`.stream.background` priority) sends
   the files of its node's ranks to ``replicas - 1`` holders (:func:`.exchange.ranking`; a
   failed holder is replaced by the next one), one thread per holder under one bandwidth cap.
   A file is held once the receiver acknowledges it with the digest
   :func:`.verify.expected_digest` predicts;
2. the leader publishes ``s<step>/<node>`` = the holders that acknowledged every file;
3. the *watcher* thread of every rank polls those keys: once every node reported ``replicas -
   1`` holders the step is protected; a node silent past ``replica_timeout_s`` leaves it not;
4. on a protected step, node leaders apply ``keep_last`` to their peer area (the newest
   ``keep_last`` protected steps and anything newer stay).

Nothing runs on the caller's thread; a dead peer delays only the transfers to it.
``close(timeout_s)`` returns within ``timeout_s``: transfers still running are cut.
"""

from __future__ import annotations

import json
import logging
import os
import queue
import threading
import time
from dataclasses import dataclass, field

from ..distributed.store import Store, StoreTimeout
from ..errors import ZerostallError
from ..format.manifest import MANIFEST_NAME, FileEntry, Manifest
from ..store.local import LocalTier
from .exchange import PeerView, in_parallel, ranking
from . import status as status_file
from . import tombstones
from .store import PeerStore
from .stream import background
from .tcp import TcpTransport
from .verify import expected_digest

log = logging.getLogger("zerostall")


@dataclass
class StepStatus:
    """One step's replication as this rank knows it. Written by the watcher thread only."""

    step: int
    deadline: float
    done: threading.Event = field(default_factory=threading.Event)
    protected: bool = False
    nodes: tuple[str, ...] = ()
    error: str = ""


class PeerReplicator:
    def __init__(self, tier: LocalTier, view: PeerView, transport: TcpTransport, store: Store, peer_store: PeerStore,
                 *, replicas: int, keep_last: int | None, replica_timeout_s: float, cpu_priority: str = "idle"):
        self.cpu_priority = cpu_priority  # the sender thread's (:func:`.stream.background`)
        self.tier, self.view, self.transport, self.store = tier, view, transport, store
        self.peer_store = peer_store
        self.replicas, self.keep_last, self.replica_timeout_s = replicas, keep_last, replica_timeout_s
        self.want = replicas - 1  # holders every node's report must name for a protected step (a code: k + m)
        self._extra: dict[int, dict[str, object]] = {}  # more of a step's report (a code's fragments)
        self._status: dict[int, StepStatus] = {}
        self._mu = threading.Lock()
        # steps seen protected, ascending, seeded from the status hint an earlier run left: after a
        # restart, retention counts that run's protected steps toward keep_last
        seen = status_file.read(tier.root).get("steps", {})
        here = set(tier.steps())  # not a step deleted since (zerostall delete)
        self._protected: list[int] = sorted(int(k) for k, v in seen.items()
                                            if isinstance(v, dict) and v.get("protected") is True and int(k) in here)
        self._q: queue.SimpleQueue[int | None] = queue.SimpleQueue()
        self._stop = threading.Event()
        self.repaired = threading.Event()  # set once the start-up repair pass finished (node leaders)
        self.bytes_sent = 0  # bytes this node's leader copied to holders (acknowledged)
        self._watch = threading.Thread(target=self._watch_loop, name="zerostall-peers-watch", daemon=True)
        self._watch.start()
        self._send: threading.Thread | None = None
        if view.leader:
            self._send = threading.Thread(target=self._send_loop, name="zerostall-peers-send", daemon=True)
            self._send.start()

    # -- any thread --------------------------------------------------------------------
    def submit(self, step: int) -> None:
        """``step`` committed on every rank (persist thread)."""
        with self._mu:
            self._status[step] = StepStatus(step, time.monotonic() + self.replica_timeout_s)
        if self._send is not None:
            self._q.put(step)

    def status(self, step: int) -> StepStatus | None:
        return self._status.get(step)

    def newest_protected(self) -> set[int]:
        """The newest step this run saw protected (empty before the first): local retention keeps
        it until a newer one is protected (persist thread, via ``protect``)."""
        with self._mu:
            return set(self._protected[-1:])

    def close(self, timeout_s: float) -> list[int]:
        """Wait up to ``timeout_s`` for steps in flight, then cut them; returns the unprotected steps."""
        deadline = time.monotonic() + timeout_s
        with self._mu:
            pending = [s for s in self._status.values() if not s.done.is_set()]
        for st in pending:
            st.done.wait(max(0.0, deadline - time.monotonic()))
        self._stop.set()
        self._q.put(None)
        self.transport.close()
        for t in (self._send, self._watch):
            if t is not None:
                t.join(max(0.0, min(1.0, deadline - time.monotonic())))
        left = []
        with self._mu:
            for st in self._status.values():
                if not st.done.is_set():
                    st.error = st.error or f"replication of step {st.step} did not finish before close"
                    st.done.set()
                if not st.protected:
                    left.append(st.step)
        if left:
            log.warning("zerostall: steps %s are not protected by %d other nodes (see their handles)", sorted(left),
                        self.want)
        return sorted(left)

    # -- sender thread (node leaders) --------------------------------------------------
    def repair(self) -> None:
        """Copy this node's kept steps to holders that lack them (a replaced holder, a run that
        ended early); on the sender thread, in order."""
        if self._send is not None:
            self._q.put(-1)

    def _send_loop(self) -> None:
        background(self.cpu_priority)
        while True:
            step = self._q.get()
            if step is None or self._stop.is_set():
                return
            if step == -1:
                self._repair()
                self.repaired.set()
                continue
            try:
                raw, man = self._step_manifest(step)
            except (OSError, ZerostallError) as exc:
                holders, error = [], f"cannot read the manifest of step {step}: {exc}"
            else:
                holders, error = self._send_step(step, raw, man)
            try:
                self.store.set(self.view.key(f"s{step}", self.view.me),
                               json.dumps({"holders": holders, "error": error, "usage": self._usage(),
                                           **self._extra.pop(step, {})}))
            except ZerostallError as exc:
                log.error("zerostall: could not publish the peer copies of step %d: %s", step, exc)

    def _usage(self) -> dict[str, object]:
        try:
            return self.peer_store.usage()
        except OSError as exc:
            return {"error": str(exc)}

    def _step_manifest(self, step: int) -> tuple[bytes, Manifest]:
        """``step``'s manifest in this node's root, raw and parsed; raises ``OSError`` or ``ZerostallError``."""
        with open(os.path.join(self.tier.step_dir(step), MANIFEST_NAME), "rb") as f:
            raw = f.read()
        return raw, Manifest.from_bytes(raw)

    def _mine(self, man: Manifest) -> list[FileEntry]:
        """This node's files of ``man``, by name."""
        v = self.view
        return sorted((fe for fe in man.files if fe.rank < len(v.rank_nodes) and v.rank_nodes[fe.rank] == v.me),
                      key=lambda fe: fe.name)

    def _put(self, node: str, step: int, raw: bytes, man: Manifest, files: list[FileEntry]) -> int:
        """Copy ``files`` of ``step`` to ``node``, each acknowledged with the digest
        :func:`.verify.expected_digest` predicts; returns their bytes (sender thread)."""
        for fe in files:
            digest = self.transport.put(self.view.endpoints[node], self.view.me, step, fe.name,
                                        os.path.join(self.tier.step_dir(step), fe.name), raw)
            if digest != expected_digest(man, fe.name):
                raise ZerostallError(f"node {node} acknowledged {fe.name} with digest {digest}, not the manifest's")
        return sum(fe.file_bytes for fe in files)

    def _send_step(self, step: int, raw: bytes, man: Manifest) -> tuple[list[str], str]:
        """Copy ``step`` to its holders: ``(holders, error)`` ("" when every copy is held)."""
        mine, want = self._mine(man), self.replicas - 1
        candidates = [n.name for n in ranking(self.view.me, self.view.nodes)]
        held: list[str] = []
        errors: list[str] = []
        mu = threading.Lock()

        def slot() -> None:
            while not self._stop.is_set():
                with mu:
                    if not candidates or len(held) >= want:
                        return
                    node = candidates.pop(0)
                try:
                    sent = self._put(node, step, raw, man, mine)
                    with mu:
                        held.append(node)
                        self.bytes_sent += sent
                    return
                except (ZerostallError, OSError) as exc:
                    log.warning("zerostall: step %d: copying to node %s failed: %s", step, node, exc)
                    with mu:
                        errors.append(f"{node}: {exc}")

        in_parallel(slot, [()] * want, "zerostall-peers-put")
        error = "" if len(held) >= want else "; ".join(errors) or "stopped"
        if error:
            log.warning("zerostall: step %d: node %s's files are held by %d of %d other nodes: %s", step,
                        self.view.me, len(held), want, error)
        return sorted(held), error

    def _kept(self) -> list[tuple[int, bytes, Manifest]]:
        """The newest ``keep_last`` local steps with their manifests, but those deleted for good or unreadable."""
        steps = self.tier.steps()
        out = []
        for step in steps if self.keep_last is None else steps[-self.keep_last:]:
            try:
                raw, man = self._step_manifest(step)
            except (OSError, ZerostallError) as exc:
                log.warning("zerostall: repair of step %d: %s", step, exc)
                continue
            if not tombstones.dead(self.view.deleted, step, man.checkpoint_id, man.created_unix):
                out.append((step, raw, man))
        return out

    def _repair(self) -> None:
        v = self.view
        steps = self._kept()
        todo = [n.name for n in ranking(v.me, v.nodes)][:self.replicas - 1] if steps else []
        for attempt in range(3):  # a holder busy restoring may time out once
            todo = [node for node in todo if not self._stop.is_set() and not self._repair_node(node, steps)]
            if not todo or self._stop.wait(1.0 * (attempt + 1)):
                return
        log.warning("zerostall: repair: node(s) %s could not be brought up to date; the next start tries again",
                    ", ".join(todo))

    def _repair_node(self, node: str, steps: list[tuple[int, bytes, Manifest]]) -> bool:
        v = self.view
        try:
            held = self.transport.list_held(v.endpoints[node])
            have = {(h["step"], h["checkpoint_id"], f) for h in held if h.get("src") == v.me for f in h["files"]}
            for step, raw, man in steps:
                todo = [fe for fe in self._mine(man) if (step, man.checkpoint_id, fe.name) not in have]
                self._put(node, step, raw, man, todo)
                for fe in todo:
                    log.info("zerostall: repair: %s of step %d copied to node %s", fe.name, step, node)
            return True
        except (OSError, ZerostallError, KeyError, TypeError, IndexError) as exc:
            log.warning("zerostall: repair: copying to node %s failed: %s", node, exc)
            return False

    # -- watcher thread (every rank) ---------------------------------------------------
    def _watch_loop(self) -> None:
        while not self._stop.is_set():
            with self._mu:
                pending = sorted((s for s in self._status.values() if not s.done.is_set()), key=lambda s: s.step)
            for st in pending:
                try:
                    self._check(st)
                except ZerostallError as exc:
                    log.debug("zerostall: peer status of step %d: %s", st.step, exc)
            self._stop.wait(0.05 if pending else 0.2)

    def _check(self, st: StepStatus) -> None:
        v = self.view
        keys = [v.key(f"s{st.step}", n.name) for n in v.nodes]
        missing = None  # set once the deadline has passed: who did not report
        try:  # a store that does not answer (a partitioned node) must not hold the step past its deadline
            with self.store.bounded(st.deadline):
                ready = self.store.check(keys)
                if not ready and time.monotonic() > st.deadline:
                    missing = ", ".join(k.rsplit("/", 1)[1] for k in self.store.missing(keys))
        except StoreTimeout as exc:
            if time.monotonic() <= st.deadline:
                return
            ready, missing = False, f"(unknown: the c10d store did not answer: {exc})"
        if not ready:
            if missing is not None:
                st.error = (f"step {st.step}: node(s) {missing} did not report their peer copies within "
                            f"replica_timeout_s={self.replica_timeout_s:g} s")
                log.warning("zerostall: %s; the step is not protected", st.error)
                st.done.set()
            return
        reports = dict(zip((n.name for n in v.nodes), self.store.multi_get_json(keys)))
        short = {n: r for n, r in reports.items() if len(r.get("holders", ())) < self.want}
        st.nodes = tuple([v.me] + list(reports[v.me].get("holders", ())))
        if short:
            st.error = "; ".join(f"{n}: {r.get('error') or 'too few holders'}" for n, r in short.items())
        else:
            st.protected = True
        st.done.set()
        if v.leader:
            try:
                status_file.record(self.tier.root, v.me, st.step, st.protected,
                                   {n: list(r.get("holders", ())) for n, r in reports.items()}, self.tier.steps(),
                                   {n: f"{e.host}:{e.port}" for n, e in v.endpoints.items()},
                                   {**{n: r["usage"] for n, r in reports.items() if isinstance(r.get("usage"), dict)},
                                    v.me: self._usage()},
                                   {"code": reports[v.me]["code"], "fragments": {n: r.get("fragments", {})
                                                                                 for n, r in reports.items()}}
                                   if "code" in reports[v.me] else None)
            except OSError as exc:
                log.debug("zerostall: could not record the peer status of step %d: %s", st.step, exc)
        if self.store.add(v.key(f"s{st.step}", "seen"), 1) == v.world:
            self.store.delete(*keys, v.key(f"s{st.step}", "seen"))
        if st.protected:
            with self._mu:
                self._protected = sorted(set(self._protected) | {st.step})
                keep = set(self._protected[-(self.keep_last or 1):])
            log.info("zerostall: step %d is protected: every node's files are held by %d other nodes", st.step,
                     self.want)
            if v.leader and self.keep_last is not None:
                try:  # the steps they borrow bytes from stay too (PeerStore.retain)
                    self.peer_store.retain(keep, min(keep))
                except (OSError, ZerostallError) as exc:
                    log.warning("zerostall: peer-copy retention failed: %s", exc)
