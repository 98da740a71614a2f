"""Coded copies, the save side: after a step committed, each node leader cuts its node's files
into k data fragments and m Reed-Solomon parity fragments (:mod:`.coding`) and sends fragment
i to holder i, k + m distinct other nodes (``peers.code="rs"``, ``peers.data_fragments``,
``peers.parity_fragments``).

:class:`CodedReplicator` is a :class:`.replicate.PeerReplicator` whose sender thread (idle I/O
class, ``peers.cpu_priority``: :mod:`.priority`) does, per step:

1. read the step's manifest; the node's files in name order make the :class:`.coding.Layout`;
2. the placement's first k + m nodes (:func:`.placement.ranking`: failure domains first) get
   fragments 0..k+m-1; a connection per holder (:class:`.fragments.Upload`);
3. stripe by stripe (:data:`.coding.STRIPE_BYTES` of every fragment): read the k data pieces
   of the files, compute the m parity pieces (zfec, GIL released), send each piece to its
   holder (one bandwidth cap for the node, :class:`.stream.Pacer`), folding it into that
   fragment's crc32c; a holder that fails or stops (``peers.timeout_s``) drops out alone;
4. announce each fragment's crc32c; a holder acknowledges with it only after it checked the
   bytes, fdatasync'ed and renamed the fragment (:class:`.fragments.FragmentStore`);
5. fragments whose holder failed go to the next nodes in the ranking (a second pass codes
   only those), then the leader publishes the holders (``s<step>/<node>``: ``holders``, and
   ``fragments`` = holder -> index). The watcher marks the step protected only once every
   node reported all k + m fragments held (``want = k + m``).

Retention is the base class's: fragments live in the holder's step directories, so
``keep_last`` counts steps. :meth:`CodedReplicator._repair` (start-up) gives the fragments of
the kept steps that no live node holds to nodes holding none of that step, recomputed from
this node's own files.
"""

from __future__ import annotations

import logging
import mmap
import os
import threading
import time
from typing import Any

import crc32c as _crc

from ..config import ALIGN_BYTES
from ..errors import ConfigError, ZerostallError
from ..format.manifest import Manifest
from .coding import STRIPE_BYTES, Code, Layout, descriptor_id
from .fragments import Upload, list_fragments
from .placement import ranking
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
    def _send_step(self, step: int) -> tuple[list[str], str]:
        v = self.view
        try:
            raw, man = self._step_manifest(step)
        except (OSError, ZerostallError) as exc:
            return [], f"cannot read the manifest of step {step}: {exc}"
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
        """One coding pass over the files: fragment i to ``plan[i]`` (module doc, 2-4)."""
        v, k, fb = self.view, self.k, lay.fragment_bytes
        failed: list[str] = []
        ups: dict[int, Upload] = {}
        for i, node in sorted(plan.items()):
            try:
                ups[i] = Upload(self.transport, v.endpoints[node], v.me, step, i, fb, raw, desc,
                                getattr(self.transport, "pacer", None))
            except (ZerostallError, OSError) as exc:
                failed.append(f"{node} (fragment {i}): {exc}")
        parity = any(i >= k for i in ups)
        crcs = dict.fromkeys(ups, 0)
        stripe = _stripe_bytes(getattr(self.transport, "pacer", None), len(plan))
        bufs = [mmap.mmap(-1, min(fb, stripe)) for _ in range(k)]
        mvs = [memoryview(b) for b in bufs]
        fds: dict[str, int] = {}
        try:
            for name, _ in lay.files:
                fds[name] = os.open(os.path.join(self.tier.step_dir(step), name), os.O_RDONLY | os.O_CLOEXEC)
            for off, n in lay.stripes(stripe):
                if not ups or self._stop.is_set():
                    break
                for i in (range(k) if parity else [i for i in ups if i < k]):
                    _read(lay, fds, i, off, n, mvs[i])
                pieces: dict[int, Any] = {i: mvs[i][:n] for i in range(k)}
                if parity:
                    t0 = time.thread_time()
                    pieces.update(enumerate(self.code.parity([mvs[i][:n] for i in range(k)]), start=k))
                    self.encode_cpu_s += time.thread_time() - t0
                for i, up in list(ups.items()):
                    crcs[i] = _crc.crc32c(pieces[i], crcs[i])
                    try:
                        up.send(pieces[i])
                    except ZerostallError as exc:
                        failed.append(f"{plan[i]} (fragment {i}): {exc}")
                        del ups[i]
            ok: dict[int, str] = {}
            for i, up in ups.items():
                if self._stop.is_set():
                    break
                try:
                    digest = up.finish(crcs[i])
                    if digest != f"{crcs[i]:08x}":
                        raise ZerostallError(f"acknowledged with crc32c {digest}, sent {crcs[i]:08x}")
                    ok[i] = plan[i]
                    with self._mu:
                        self.fragment_bytes_sent += fb
                        self.bytes_sent += fb
                except (ZerostallError, OSError) as exc:
                    log.warning("zerostall: step %d: fragment %d to node %s failed: %s", step, i, plan[i], exc)
                    failed.append(f"{plan[i]} (fragment {i}): {exc}")
            return ok, failed
        finally:
            for up in ups.values():
                up.close()
            for fd in fds.values():
                try:
                    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)  # read once, for the copies
                except OSError:
                    pass
                os.close(fd)
            for mv, b in zip(mvs, bufs):
                try:
                    mv.release()
                    b.close()
                except BufferError:  # a slice still referenced (an exception's frames): unmapped by the GC
                    pass

    # -- start-up repair (sender thread) -------------------------------------------------
    def _repair(self) -> None:
        v = self.view
        steps = self.tier.steps()
        if self.keep_last is not None:
            steps = steps[-self.keep_last:]
        if not steps:
            return
        lists: dict[str, list[dict[str, Any]]] = {}

        def ask(node: str) -> None:
            try:
                lists[node] = list_fragments(self.transport, v.endpoints[node], v.me)
            except (ZerostallError, OSError) as exc:
                log.warning("zerostall: repair: node %s did not list its fragments: %s", node, exc)
        threads = [threading.Thread(target=ask, args=(n.name,), daemon=True) for n in v.nodes if n.name != v.me]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        candidates = [n.name for n in ranking(v.me, v.nodes) if n.name in lists]
        for step in steps:
            if self._stop.is_set():
                return
            try:
                raw, man = self._step_manifest(step)
            except (OSError, ZerostallError) as exc:
                log.warning("zerostall: repair of step %d: %s", step, exc)
                continue
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
    """Bytes of each fragment per stripe. The holders are fed in turn, so with a bandwidth cap
    one waits for the other fragments' pieces between two of its own: two pacer pieces
    (``rate * timeout_s / 8`` each) across all fragments keep that wait near a quarter of
    ``peers.timeout_s``, after which the holder would give up."""
    if pacer is None or not pacer.rate:
        return STRIPE_BYTES
    return max(ALIGN_BYTES, min(STRIPE_BYTES, 2 * pacer.piece_bytes // fragments // ALIGN_BYTES * ALIGN_BYTES))


def _read(lay: Layout, fds: dict[str, int], index: int, off: int, n: int, mv: memoryview) -> None:
    """Bytes ``[off, off + n)`` of data fragment ``index`` into ``mv`` (padding as zeros)."""
    for name, foff, at, length in lay.pieces(index, off, n):
        dst = mv[at - off:at - off + length]
        if name is None:
            dst[:] = bytes(length)
            continue
        got = 0
        while got < length:
            r = os.preadv(fds[name], [dst[got:]], foff + got)
            if r <= 0:
                raise ZerostallError(f"{name} is shorter than its manifest says (offset {foff + got})")
            got += r
