"""Coded copies, the save side (``peers.code="rs"``): after a step committed, each node leader cuts
its node's files into k data and m parity fragments (:mod:`.coding`) and sends fragment i to
the i-th of k + m other nodes (:func:`.exchange.ranking`).

:class:`CodedReplicator` is a :class:`.replicate.PeerReplicator` whose sender thread, per step,
reads the files stripe by stripe, computes parity (zfec, GIL released) and hands each stripe to
its fragment's :class:`_Feed` thread (all under the node's one :class:`.stream.Pacer`); two
buffer sets let the coding of a stripe overlap the sending of the one before. A holder that
fails, stops or falls a set behind for half of ``peers.timeout_s`` drops out alone, and its
fragment goes to the next node in the ranking (a second pass codes only those). A holder
acknowledges a fragment only once it is checked, fdatasync'ed and renamed (:mod:`.fragments`);
the step is protected once every node reported all k + m fragments held.

Retention is the base class's. :meth:`CodedReplicator._repair` (start-up) recomputes the
fragments of the kept steps that no live node holds of this commit.
"""

from __future__ import annotations

import contextlib
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
from .stream import at, shutdown, unmap
from .wire import PeerError, recv_msg, recv_ok, send_msg
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
        self.encode_cpu_s = 0.0  # CPU seconds spent computing parity (bench)
        self.fragment_bytes_sent = 0  # bytes of fragments acknowledged by holders (bench)
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
        return Layout(tuple((fe.name, fe.file_bytes) for fe in self._mine(man)), self.k, self.m)

    def _place(self, step: int, lay: Layout, raw: bytes, desc: bytes, todo: list[int], candidates: list[str],
               used: set[str]) -> tuple[dict[int, str], list[str]]:
        """Fragments ``todo`` to the first unused ``candidates`` (the next on a failure): ``({index: holder}, errors)``."""
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
        """One coding pass over the files: fragment i to ``plan[i]``, each on a :class:`_Feed`."""
        v, k, fb = self.view, self.k, lay.fragment_bytes
        parity = any(i >= k for i in plan)
        stripe = _stripe_bytes(self.transport.pacer, len(plan))
        sets = [[mmap.mmap(-1, min(fb, stripe)) for _ in range(k)] for _ in range(BUFFER_SETS)]
        mvs = [[memoryview(b) for b in bufs] for bufs in sets]
        cond = threading.Condition()
        feeds = {i: _Feed(self, cond, step, i, node, raw, desc, fb) for i, node in sorted(plan.items())}
        lag_s = self.transport.timeout_s / 2
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
                with contextlib.suppress(OSError):
                    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)  # read once, for the copies
                os.close(fd)
            for mv in (m for ms in mvs for m in ms):
                with contextlib.suppress(BufferError):  # a slice still referenced: unmapped by the GC
                    mv.release()
            unmap([b for bs in sets for b in bs])
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
        steps = self._kept()
        if not steps:
            return
        lists = ask_peers(v, lambda ep: self.transport.list_held(ep, "flist", src=v.me), "repair")
        candidates = [n.name for n in ranking(v.me, v.nodes) if n.name in lists]
        for step, raw, man in steps:
            if self._stop.is_set():
                return
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
    """Bytes of each fragment per stripe: under a cap, two pacer pieces across all fragments keep
    a feed's wait for the others' stripes near a quarter of ``peers.timeout_s``."""
    if pacer is None or not pacer.rate:
        return STRIPE_BYTES
    return max(ALIGN_BYTES, min(STRIPE_BYTES, 2 * pacer.piece_bytes // fragments // ALIGN_BYTES * ALIGN_BYTES))


BUFFER_SETS = 2  # stripe s is coded into one set while the feeds send s - 1 from the other


class _Feed:
    """One fragment on its way to its holder (``fput``), on a thread of its own (at the sender
    thread's priority): sends the ``(stripe number, buffer)`` items of ``q`` (``None``: the last
    was sent) under the node's pacer, then its crc32c, and waits for the acknowledgement.
    ``sent`` and ``dead`` are written under ``cond``, which the sender thread waits on before it
    reuses a buffer set."""

    def __init__(self, rep: "CodedReplicator", cond: threading.Condition, step: int, index: int, node: str,
                 raw: bytes, desc: bytes, size: int):
        self.rep, self.cond, self.step, self.index, self.node = rep, cond, step, index, node
        self.raw, self.desc, self.size = raw, desc, size
        self.q: queue.SimpleQueue[tuple[int, Any] | None] = queue.SimpleQueue()
        self.sent = -1
        self.dead = False
        self.acked = False
        self.error = ""
        self.sock: socket.socket | None = None
        self.thread = threading.Thread(target=self._run, name="zerostall-peers-fput", daemon=True)

    def _run(self) -> None:
        rep = self.rep
        try:
            self.sock = rep.transport.open(rep.view.endpoints[self.node], "frag-send")
            send_msg(self.sock, {"op": "fput", "src": rep.view.me, "step": self.step, "index": self.index,
                                 "size": self.size, "manifest_bytes": len(self.raw), "coding_bytes": len(self.desc)})
            self.sock.sendall(self.raw + self.desc)
            crc = nbytes = 0
            while (item := self.q.get()) is not None and not self.dead:
                s, piece = item
                crc = _crc.crc32c(piece, crc)
                self._send(piece, nbytes)
                nbytes += len(piece)
                with self.cond:
                    self.sent = s
                    self.cond.notify_all()
            if not self.dead:
                at("frag-send:sent")
                send_msg(self.sock, {"crc32c": crc})
                reply = recv_ok(self.sock, f"node {self.node} refused fragment {self.index}")
                if reply.get("digest") != f"{crc:08x}":
                    raise ZerostallError(f"acknowledged with crc32c {reply.get('digest')}, sent {crc:08x}")
                self.acked = True
        except Exception as exc:  # noqa: BLE001 - any failure drops this holder alone
            self.error = self.error or str(exc)
        finally:
            sock, self.sock = self.sock, None
            if sock is not None:
                rep.transport.release(sock)
            with self.cond:
                self.dead = self.dead or not self.acked
                self.cond.notify_all()

    def _send(self, mv: Any, before: int) -> None:
        """One stripe (``before`` bytes of the fragment sent already): sent, then paid for."""
        pacer = self.rep.transport.pacer
        piece = pacer.piece_bytes if pacer.rate else len(mv)
        try:
            for a in range(0, len(mv), piece):
                n = min(piece, len(mv) - a)
                self.sock.sendall(mv[a:a + n])
                pacer.take(n)
        except OSError as exc:
            reply: dict[str, Any] = {}
            if isinstance(exc, (ConnectionResetError, BrokenPipeError)):  # the holder's reason may wait in
                with contextlib.suppress(OSError, ValueError, ZerostallError):  # our receive buffer after the reset
                    self.sock.settimeout(min(1.0, self.sock.gettimeout() or 1.0))
                    reply = recv_msg(self.sock)
            if reply.get("error") and not reply.get("ok"):
                raise PeerError(f"node {self.node} refused fragment {self.index}: {reply['error']}") from exc
            raise PeerError(f"node {self.node}: fragment {self.index} cut after {before} bytes: {exc}") from exc
        if before < self.size // 2 <= before + len(mv):
            at("frag-send:mid-stream")

    def abort(self, why: str) -> None:
        """Drop this holder (sender thread): a send in flight is cut (shut down; the feed's thread closes it)."""
        with self.cond:
            if self.acked or self.dead:
                return
            self.dead, self.error = True, why
            self.cond.notify_all()
        sock = self.sock
        if sock is not None:
            shutdown(sock, socket.SHUT_RDWR)


def _wait_for(cond: threading.Condition, feeds: list[_Feed], stripe: int, lag_s: float,
              stop: threading.Event) -> None:
    """Until every feed of ``feeds`` sent stripe ``stripe`` (or died); one still short of it after
    ``lag_s`` is dropped, before the other holders, fed nothing meanwhile, time out."""
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

