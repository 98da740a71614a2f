"""Coded copies, the save side: after a step committed, each node leader cuts its node's files
into k data fragments and m Reed-Solomon parity fragments (:mod:`.coding`) and sends fragment
i to holder i, k + m distinct other nodes (``peers.code="rs"``, ``peers.data_fragments``,
``peers.parity_fragments``).

:class:`CodedReplicator` is a :class:`.replicate.PeerReplicator` whose sender thread (idle I/O
class, ``peers.cpu_priority``: :func:`.stream.background`) does, per step:

1. read the step's manifest; the node's files in name order make the :class:`.coding.Layout`;
2. the placement's first k + m nodes (:func:`.exchange.ranking`: failure domains first) get
   fragments 0..k+m-1; a connection per holder (:class:`.fragments.Upload`);
3. stripe by stripe (:data:`.coding.STRIPE_BYTES` of every fragment): read the k data pieces
   of the files, compute the m parity pieces (zfec, GIL released), hand each piece to its
   fragment's feed thread (:class:`_Feed`, one per holder, all sending side by side under one
   bandwidth cap for the node, :class:`.stream.Pacer`), which folds it into that fragment's
   crc32c; two sets of stripe buffers (:data:`BUFFER_SETS`) let the coding of a stripe overlap
   the sending of the one before; a holder that fails, stops or falls a set behind for half of
   ``peers.timeout_s`` drops out alone;
4. announce each fragment's crc32c; a holder acknowledges with it only after it checked the
   bytes, fdatasync'ed and renamed the fragment (:class:`.fragments.FragmentStore`);
5. fragments whose holder failed go to the next nodes in the ranking (a second pass codes
   only those), then the leader publishes the holders (``s<step>/<node>``: ``holders``, and
   ``fragments`` = holder -> index). The watcher marks the step protected only once every
   node reported all k + m fragments held (``want = k + m``).

Retention is the base class's: fragments live in the holder's step directories, so
``keep_last`` counts steps. :meth:`CodedReplicator._repair` (start-up) gives the fragments of
the kept steps that no live node holds to nodes holding none of that step, recomputed from
this node's own files: the fragments of the commit in this node's manifest (the descriptor
names its checkpoint id, so a holder's fragment of another commit of the step counts for
nothing), never of a step deleted for good (:mod:`.tombstones`), as the replica repair.
"""

from __future__ import annotations

import logging
import mmap
import os
import queue
import socket
import threading
import time
from typing import Any

import crc32c as _crc

from ..config import ALIGN_BYTES
from ..errors import ConfigError, ZerostallError
from ..format.manifest import Manifest
from .coding import STRIPE_BYTES, Code, Layout, descriptor_id
from .fragments import Upload, list_fragments
from . import tombstones
from .exchange import ask_peers, ranking
from .replicate import PeerReplicator

__all__ = ["CodedReplicator", "check_cluster"]
log = logging.getLogger("zerostall")


def check_cluster(k: int, m: int, nodes: list[str]) -> None:
    """Refuse a job too small for RS(k, m): the owner and k + m holders on distinct nodes."""
    if len(nodes) < k + m + 1:
        raise ConfigError(f"peers.code='rs' with data_fragments={k} and parity_fragments={m} puts {k + m} fragments "
                          f"of each node's files on {k + m} other nodes, so it needs at least {k + m + 1} nodes; this "
                          f"job has {len(nodes)} ({', '.join(nodes)}): lower data_fragments + parity_fragments to "
                          f"at most {len(nodes) - 1}, or use replicas=N")


class CodedReplicator(PeerReplicator):
    def __init__(self, *args: Any, data_fragments: int, parity_fragments: int, **kw: Any):
        self.code = Code(data_fragments, parity_fragments)
        self.k, self.m = data_fragments, parity_fragments
        self.encode_cpu_s = 0.0
        """CPU seconds the sender thread spent computing parity (bench)."""
        self.fragment_bytes_sent = 0
        """Bytes of fragments acknowledged by holders (bench)."""
        super().__init__(*args, **kw)
        self.want = self.k + self.m

    # -- sender thread -----------------------------------------------------------------
    def _send_step(self, step: int, raw: bytes, man: Manifest) -> tuple[list[str], str]:
        v = self.view
        lay = self._layout(man)
        desc = lay.describe(step, man.checkpoint_id, v.me)
        candidates = [n.name for n in ranking(v.me, v.nodes)]
        assign, errors = self._place(step, lay, raw, desc, list(range(self.k + self.m)), candidates, set())
        held = sorted(assign.values())
        self._extra[step] = {"fragments": {node: i for i, node in assign.items()}, "code": [self.k, self.m]}
        error = "" if len(assign) == self.k + self.m else "; ".join(errors) or "stopped"
        if error:
            log.warning("zerostall: step %d: %d of %d fragments of node %s's files are held: %s", step, len(assign),
                        self.k + self.m, v.me, error)
        return held, error

    def _layout(self, man: Manifest) -> Layout:
        v = self.view
        mine = sorted((fe for fe in man.files if fe.rank < len(v.rank_nodes) and v.rank_nodes[fe.rank] == v.me),
                      key=lambda fe: fe.name)
        return Layout(tuple((fe.name, fe.file_bytes) for fe in mine), self.k, self.m)

    def _place(self, step: int, lay: Layout, raw: bytes, desc: bytes, todo: list[int], candidates: list[str],
               used: set[str]) -> tuple[dict[int, str], list[str]]:
        """Send fragments ``todo`` to the first unused ``candidates``, the next ones for those
        that fail: ``({index: holder}, errors)``."""
        assign: dict[int, str] = {}
        errors: list[str] = []
        while todo and not self._stop.is_set():
            plan: dict[int, str] = {}
            for i in todo:
                node = next((c for c in candidates if c not in used), None)
                if node is None:
                    break
                used.add(node)
                plan[i] = node
            if not plan:
                errors.append(f"no node left for fragment(s) {todo}")
                break
            ok, failed = self._code_and_send(step, lay, raw, desc, plan)
            assign.update(ok)
            errors.extend(failed)
            todo = [i for i in todo if i not in assign]
        return assign, errors

    def _code_and_send(self, step: int, lay: Layout, raw: bytes, desc: bytes,
                       plan: dict[int, str]) -> tuple[dict[int, str], list[str]]:
        """One coding pass over the files: fragment i to ``plan[i]`` (module doc, 2-4). This
        thread reads and codes; each fragment goes out on a :class:`_Feed` thread of its own."""
        v, k, fb = self.view, self.k, lay.fragment_bytes
        parity = any(i >= k for i in plan)
        stripe = _stripe_bytes(getattr(self.transport, "pacer", None), len(plan))
        sets = [[mmap.mmap(-1, min(fb, stripe)) for _ in range(k)] for _ in range(BUFFER_SETS)]
        mvs = [[memoryview(b) for b in bufs] for bufs in sets]
        cond = threading.Condition()
        feeds = {i: _Feed(self, cond, step, i, node, raw, desc, fb) for i, node in sorted(plan.items())}
        lag_s = getattr(self.transport, "timeout_s", 60.0) / 2
        fds: dict[str, int] = {}
        coded = False
        try:
            for f in feeds.values():
                f.thread.start()
            for name, _ in lay.files:
                fds[name] = os.open(os.path.join(self.tier.step_dir(step), name), os.O_RDONLY | os.O_CLOEXEC)
            for s, (off, n) in enumerate(lay.stripes(stripe)):
                live = [f for f in feeds.values() if not f.dead]
                if not live or self._stop.is_set():
                    break
                _wait_for(cond, live, s - BUFFER_SETS, lag_s, self._stop)
                bufs = mvs[s % BUFFER_SETS]
                for i in (range(k) if parity else [i for i in feeds if i < k and not feeds[i].dead]):
                    lay.read(fds.__getitem__, i, off, bufs[i][:n])
                pieces: dict[int, Any] = {i: bufs[i][:n] for i in range(k)}
                if parity:
                    t0 = time.thread_time()
                    pieces.update(enumerate(self.code.parity([bufs[i][:n] for i in range(k)]), start=k))
                    self.encode_cpu_s += time.thread_time() - t0
                for i, f in feeds.items():
                    if not f.dead:
                        f.q.put((s, pieces[i]))
            for f in feeds.values():
                if self._stop.is_set():
                    f.abort("stopped")
                f.q.put(None)
            coded = True
        finally:
            if not coded:  # an exception: no feed waits for a stripe that will not come
                for f in feeds.values():
                    f.abort("the coding pass failed")
                    f.q.put(None)
            for f in feeds.values():
                if f.thread.ident is not None:
                    f.thread.join()
            for fd in fds.values():
                try:
                    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)  # read once, for the copies
                except OSError:
                    pass
                os.close(fd)
            for mv, b in zip((m for ms in mvs for m in ms), (b for bs in sets for b in bs)):
                try:
                    mv.release()
                    b.close()
                except BufferError:  # a slice still referenced (an exception's frames): unmapped by the GC
                    pass
        ok: dict[int, str] = {}
        failed: list[str] = []
        for i, f in feeds.items():
            if f.acked:
                ok[i] = plan[i]
                with self._mu:
                    self.fragment_bytes_sent += fb
                    self.bytes_sent += fb
            else:
                log.warning("zerostall: step %d: fragment %d to node %s failed: %s", step, i, plan[i],
                            f.error or "stopped")
                failed.append(f"{plan[i]} (fragment {i}): {f.error or 'stopped'}")
        return ok, failed

    # -- start-up repair (sender thread) -------------------------------------------------
    def _repair(self) -> None:
        v = self.view
        steps = self.tier.steps()
        if self.keep_last is not None:
            steps = steps[-self.keep_last:]
        if not steps:
            return
        lists = ask_peers(v, lambda ep: list_fragments(self.transport, ep, v.me), "repair")
        candidates = [n.name for n in ranking(v.me, v.nodes) if n.name in lists]
        for step in steps:
            if self._stop.is_set():
                return
            try:
                raw, man = self._step_manifest(step)
            except (OSError, ZerostallError) as exc:
                log.warning("zerostall: repair of step %d: %s", step, exc)
                continue
            if tombstones.dead(v.deleted, step, man.checkpoint_id, man.created_unix):
                continue  # deleted for good on some node (zerostall delete): no fragments of it again
            lay = self._layout(man)
            desc = lay.describe(step, man.checkpoint_id, v.me)
            held: dict[int, str] = {}
            for node, hs in lists.items():
                for h in hs:
                    if h.get("step") == step and h.get("descriptor") == descriptor_id(desc):
                        for i in h.get("fragments", {}):
                            held.setdefault(int(i), node)
            todo = [i for i in range(self.k + self.m) if i not in held]
            if not todo:
                continue
            log.info("zerostall: repair: fragments %s of step %d are held by no live node; recomputing them", todo,
                     step)
            assign, errors = self._place(step, lay, raw, desc, todo, candidates, set(held.values()))
            for i, node in assign.items():
                log.info("zerostall: repair: fragment %d of step %d sent to node %s", i, step, node)
            if errors:
                log.warning("zerostall: repair of step %d: %s", step, "; ".join(errors))


def _stripe_bytes(pacer: Any, fragments: int) -> int:
    """Bytes of each fragment per stripe. The feeds share the node's pacer, so with a bandwidth
    cap a feed waits for the other feeds' stripes between two of its own: two pacer pieces
    (``rate * timeout_s / 8`` each) across all fragments keep that wait near a quarter of
    ``peers.timeout_s``, after which the holder would give up."""
    if pacer is None or not pacer.rate:
        return STRIPE_BYTES
    return max(ALIGN_BYTES, min(STRIPE_BYTES, 2 * pacer.piece_bytes // fragments // ALIGN_BYTES * ALIGN_BYTES))


BUFFER_SETS = 2
"""Sets of k data-stripe buffers: the sender thread reads and codes stripe s into one while the
feeds still send stripe s - 1 from the other; a set is reused only once every live feed sent it."""


class _Feed:
    """One fragment on its way to its holder (:class:`.fragments.Upload`), on a thread of its
    own: started by the replicator's sender thread (so at the replication's CPU and I/O
    priority, :func:`.stream.background`), it connects, sends the stripes the sender thread puts in
    ``q`` in order (``(stripe number, buffer)``; ``None``: the last one was sent), folds each
    into the fragment's crc32c, announces it and waits for the holder's acknowledgement. Every
    feed shares the node's pacer, so the holders are fed side by side at the node's cap.

    ``sent`` (the last stripe number sent) and ``dead`` are written under ``cond`` by this
    thread, ``dead`` also by :meth:`abort` (the sender thread); the sender thread waits on
    ``cond`` before it reuses a buffer set."""

    def __init__(self, rep: "CodedReplicator", cond: threading.Condition, step: int, index: int, node: str,
                 raw: bytes, desc: bytes, size: int):
        self.rep, self.cond, self.step, self.index, self.node = rep, cond, step, index, node
        self.raw, self.desc, self.size = raw, desc, size
        self.q: queue.SimpleQueue[tuple[int, Any] | None] = queue.SimpleQueue()
        self.sent = -1
        self.dead = False
        self.acked = False
        self.error = ""
        self.ended = threading.Event()
        self._up: Upload | None = None
        self.thread = threading.Thread(target=self._run, name="zerostall-peers-fput", daemon=True)

    def _run(self) -> None:
        rep = self.rep
        try:
            self._up = Upload(rep.transport, rep.view.endpoints[self.node], rep.view.me, self.step, self.index,
                              self.size, self.raw, self.desc, getattr(rep.transport, "pacer", None))
            crc = 0
            while True:
                item = self.q.get()
                if item is None or self.dead:
                    break
                s, piece = item
                crc = _crc.crc32c(piece, crc)
                self._up.send(piece)
                with self.cond:
                    self.sent = s
                    self.cond.notify_all()
            if not self.dead:
                digest = self._up.finish(crc)
                if digest != f"{crc:08x}":
                    raise ZerostallError(f"acknowledged with crc32c {digest}, sent {crc:08x}")
                self.acked = True
        except Exception as exc:  # noqa: BLE001 - any failure drops this holder alone
            self.error = self.error or str(exc)
        finally:
            up, self._up = self._up, None
            if up is not None:
                up.close()
            with self.cond:
                self.dead = self.dead or not self.acked
                self.cond.notify_all()
            self.ended.set()

    def abort(self, why: str) -> None:
        """Drop this holder (sender thread): its thread stops at its next step; a send in
        flight is cut (the socket is shut down, not closed: the feed's thread closes it)."""
        with self.cond:
            if self.acked or self.dead:
                return
            self.dead, self.error = True, why
            self.cond.notify_all()
        up = self._up
        sock = up.sock if up is not None else None
        if sock is not None:
            try:
                sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass


def _wait_for(cond: threading.Condition, feeds: list[_Feed], stripe: int, lag_s: float,
              stop: threading.Event) -> None:
    """Until every feed of ``feeds`` sent stripe ``stripe`` (or died). A feed still short of it
    after ``lag_s`` (half of ``peers.timeout_s``) is dropped: its holder stopped or crawls, and
    the other holders, fed nothing meanwhile, would give up on their transfers after
    ``peers.timeout_s`` without progress."""
    if stripe < 0:
        return
    deadline = time.monotonic() + lag_s
    with cond:
        while not stop.is_set():
            behind = [f for f in feeds if not f.dead and f.sent < stripe]
            if not behind:
                return
            left = deadline - time.monotonic()
            if left <= 0:
                break
            cond.wait(min(left, 0.5))
    for f in feeds:
        if not f.dead and f.sent < stripe:
            f.abort(f"stopped: still sending stripe {f.sent + 1} after {lag_s:g} s, while the others were at "
                    f"stripe {stripe + BUFFER_SETS}")

