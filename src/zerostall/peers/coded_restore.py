"""Coded copies, the restore side: which steps live holders can rebuild this node's files of
(:func:`holdings`, every rank before the agreement) and the rebuild (:func:`rebuild`, the
node's leader, run by :func:`.fetch.fetch`), into ``step-N.partial``, every phase beside the others:

1. k fetch threads take the fragments in index order (data first), each from its next holder
   when one fails. A data fragment's bytes are checked as they stream in (:class:`.verify.PieceCheck`)
   and written straight into the node's files with O_DIRECT; a parity fragment goes into a
   ``.fragment-<i>`` scratch file. Each fragment's crc32c is checked at its last byte.
2. The missing data fragments are decoded stripe by stripe as the k fragments stream in
   (:class:`.coded_decode.StripeDecoder`); when one it used fails, again after the fetch.
3. Every file's check is finished, the files fdatasync'ed, the scratch files removed, and the
   step committed (the steps it references first). Events go to a :class:`.coded_decode.Timeline`.
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
from dataclasses import dataclass, field
from typing import Any, Callable

from ..errors import CheckpointNotFound, CorruptCheckpoint, ZerostallError
from ..format.layout import shard_name
from ..format.manifest import Manifest
from ..io.base import Engine
from ..store.local import LocalTier
from . import tombstones
from .coded_decode import StripeDecoder, Timeline, scatter
from .coding import Layout
from .exchange import PeerView, ask_peers, in_parallel
from .fetch import commit_with_refs
from .fragments import FragmentCheck, download
from .verify import PieceCheck

__all__ = ["Rebuild", "holdings", "rebuild"]
log = logging.getLogger("zerostall")


@dataclass(frozen=True)
class Rebuild:
    """One step's coding as live holders hold it: fragment index -> holder nodes."""

    step: int
    checkpoint_id: str
    descriptor: str
    k: int
    m: int
    holders: dict[int, list[str]] = field(default_factory=dict)


def holdings(view: PeerView, transport: Any) -> dict[int, dict[str, Rebuild]]:
    """step -> checkpoint id -> :class:`Rebuild` for every commit of a step of this node of which
    live nodes hold at least k fragments of one coding (the ranks' agreement picks the commit)."""
    lists = ask_peers(view, lambda ep: transport.list_held(ep, "flist", src=view.me), "restore")
    groups: dict[tuple[int, str, str, int, int], dict[int, list[str]]] = {}
    for node, held in sorted(lists.items()):
        for h in held:
            try:
                key = (int(h["step"]), str(h["checkpoint_id"]), str(h["descriptor"]), int(h["k"]), int(h["m"]))
                if tombstones.dead(view.deleted, key[0], key[1], h.get("created_unix")):
                    continue  # deleted for good (zerostall delete): never rebuilt
                for i in h["fragments"]:
                    if 0 <= int(i) < key[3] + key[4]:
                        groups.setdefault(key, {}).setdefault(int(i), []).append(node)
            except (KeyError, TypeError, ValueError):
                continue
    out: dict[int, dict[str, Rebuild]] = {}
    for (step, ckpt, desc, k, m), frags in groups.items():
        ids = out.setdefault(step, {})
        if len(frags) >= k and (ckpt not in ids or len(frags) > len(ids[ckpt].holders)):
            ids[ckpt] = Rebuild(step, ckpt, desc, k, m, frags)
    return {step: ids for step, ids in out.items() if ids}


def _pick(coded: dict[int, dict[str, Rebuild]], step: int, checkpoint_id: str) -> Rebuild:
    """The coding of ``step`` to rebuild: that of commit ``checkpoint_id`` ("": the one held
    by the most fragments); :class:`CheckpointNotFound` when live nodes hold too few."""
    ids = coded.get(step, {})
    if checkpoint_id and checkpoint_id in ids:
        return ids[checkpoint_id]
    if checkpoint_id or not ids:
        raise CheckpointNotFound(f"restore of step {step}: live nodes hold fewer than k fragments of its commit "
                                 f"{checkpoint_id or '(any)'}"
                                 + (f" (only of {', '.join(sorted(ids))})" if ids else ""))
    return max(ids.values(), key=lambda r: len(r.holders))


class _FragmentWriter:
    """Fragment ``index``'s bytes as they come: a data fragment's checked and written into the
    node's files (:func:`.coded_decode.scatter`), a parity fragment's into its scratch file;
    reports how far it is written. One fetch thread; :meth:`close` always."""

    def __init__(self, engine: Engine, lay: Layout, part: str, index: int, checks: dict[str, PieceCheck],
                 written: Callable[[int, int], None]):
        self.engine, self.lay, self.part, self.index = engine, lay, part, index
        self.data, self.checks, self.written = index < lay.k, checks, written
        self._open: dict[str, Any] = {}
        if not self.data:
            self._open[""] = engine.open_write(os.path.join(part, f".fragment-{index}"), lay.fragment_bytes)

    def write(self, extents: list[tuple[int, memoryview]], overlap: Callable[[], None] | None = None) -> None:
        if not self.data:
            self._open[""].write(extents, overlap)
        for off, mv in extents:
            if self.data:
                scatter(self.engine, self.lay, self.part, self.index, off, mv, self.checks, self._open)
            self.written(off, len(mv))
        if overlap is not None and self.data:
            overlap()

    def close(self) -> None:
        for w in self._open.values():
            w.close()


def rebuild(view: PeerView, transport: Any, tier: LocalTier, engine_for: Callable[[], Engine], step: int,
            coded: dict[int, dict[str, Rebuild]], checkpoint_id: str = "", timeline: Timeline | None = None) -> None:
    """The module doc's steps 1-3 for ``step`` (and the steps it references) of the agreed
    ``checkpoint_id``; ``timeline``: where the rebuild's events go."""
    tl = timeline if timeline is not None else Timeline()
    names = [shard_name(r) for r in view.ranks_of(view.me)]
    man = _rebuild_step(view, transport, tier, engine_for, _pick(coded, step, checkpoint_id), names, tl)

    def bring(ref: int) -> Manifest:
        ref_ids = {r.file_id for r in man.ref_files if r.step == ref and r.name in names}
        if ref not in coded or len(ref_ids) != 1:
            raise CheckpointNotFound(f"restore of step {step}: it references step {ref}, of which live nodes "
                                     f"hold fewer than k fragments of {', '.join(names)}")
        return _rebuild_step(view, transport, tier, engine_for, _pick(coded, ref, ref_ids.pop()), names, tl)
    commit_with_refs(tier, step, man, names, bring)  # never drops a committed step's own files
    tl.mark("committed")


def _rebuild_step(view: PeerView, transport: Any, tier: LocalTier, engine_for: Callable[[], Engine], rb: Rebuild,
                  names: list[str], tl: Timeline) -> Manifest:
    part = tier.begin(rb.step)
    engine = engine_for()
    mu = threading.Lock()
    got: dict[int, str] = {}  # index -> where from
    errors: list[str] = []
    pending = sorted(rb.holders)  # data fragments first
    meta: dict[str, Any] = {}
    firsts: dict[str, Any] = {}  # each file's creating writer: fdatasync'ed once all is in
    checks: dict[str, PieceCheck] = {}
    early: list[Any] = []  # the decode that runs beside the streams: [thread, result box]
    # what the first k fragments on offer leave out: decoded while the streams go on
    use0 = pending[:rb.k]
    missing0 = [i for i in range(rb.k) if i not in use0]

    def setup(man_bytes: bytes, desc: bytes, where: str) -> Layout:
        with mu:
            if "lay" not in meta:
                man = Manifest.from_bytes(man_bytes)
                lay, doc = Layout.parse(desc, where)
                if man.step != rb.step or man.checkpoint_id != rb.checkpoint_id or \
                        sorted(n for n, _ in lay.files) != sorted(names):
                    raise CorruptCheckpoint(f"{where}: the fragment describes other files or another checkpoint",
                                            path=where)
                for name, size in lay.files:
                    firsts[name] = engine.open_write(os.path.join(part, name), size)
                    checks[name] = PieceCheck(man, name, f"step {rb.step} {name} rebuilt from fragments")
                meta.update(lay=lay, man=man, desc=desc, dec=StripeDecoder(engine, lay, part, checks, tl))
                if missing0 and len(use0) == rb.k:
                    box: list[Any] = []
                    t = threading.Thread(target=_run_decode, args=(meta["dec"], use0, missing0, box),
                                         name="zerostall-peers-decode", daemon=True)
                    early.extend([t, box])
                    t.start()
            elif desc != meta["desc"]:
                raise CorruptCheckpoint(f"{where}: a fragment of another coding of the step", path=where)
            return meta["lay"]

    def one_fragment(i: int, node: str) -> None:
        where = f"{node}:{view.me}/step-{rb.step}/fragment-{i}"
        opened: list[Any] = []
        fed: list[Any] = []

        def written(off: int, n: int) -> None:
            meta["dec"].advance(i, off + n)
            tl.mark("checked", i, node, n)

        def sink(man_bytes: bytes, desc: bytes, head: dict[str, Any]) -> tuple[Any, FragmentCheck]:
            lay = setup(man_bytes, desc, where)
            tl.mark("set-up", i, node)
            w = _FragmentWriter(engine, lay, part, i, checks, written)
            opened.append(w)
            fed.append(FragmentCheck())
            return w, fed[0]
        tl.mark("request", i, node)
        try:
            download(transport, view.endpoints[node], view.me, rb.step, i, sink,
                     connected=lambda: tl.mark("connected", i, node), first_byte=lambda: tl.mark("first-byte", i, node))
            tl.mark("last-byte", i, node, fed[0].n)
        except BaseException:
            for c in checks.values():
                c.forget(i)
            if "dec" in meta:
                meta["dec"].fail(i)
            tl.mark("failed", i, node, fed[0].n if fed else 0)
            if i >= rb.k:
                with contextlib.suppress(OSError):
                    os.unlink(os.path.join(part, f".fragment-{i}"))
            raise
        finally:
            for w in opened:
                w.close()

    inflight = [0]

    def worker() -> None:  # k of them: a worker whose fragment failed takes the next one
        while True:
            with mu:
                if len(got) + inflight[0] >= rb.k or not pending:
                    return
                i = pending.pop(0)
                inflight[0] += 1
            try:
                for node in rb.holders[i]:
                    try:
                        one_fragment(i, node)
                        with mu:
                            got[i] = node
                        tl.mark("done", i, node)
                        log.info("zerostall: restore of step %d: fragment %d served by peer %s", rb.step, i, node)
                        break
                    except (ZerostallError, OSError) as exc:
                        log.warning("zerostall: restore of step %d: fragment %d from node %s failed: %s", rb.step,
                                    i, node, exc)
                        with mu:
                            errors.append(f"fragment {i} from {node}: {exc}")
            finally:
                with mu:
                    inflight[0] -= 1

    ok = False
    try:
        in_parallel(worker, [()] * rb.k, "zerostall-peers-fragment")
        if "dec" in meta:
            meta["dec"].end()
        if early:
            early[0].join()
        if len(got) < rb.k:
            raise CheckpointNotFound(f"restore of step {rb.step}: {len(got)} of the {rb.k} fragments needed came "
                                     f"in ({'; '.join(errors) or 'no live holder'})")
        lay, man = meta["lay"], meta["man"]
        missing = [i for i in range(rb.k) if i not in got]
        if missing and not (early and early[1] == [True] and meta["dec"].clean(use0) and set(use0) <= set(got)):
            log.info("zerostall: restore of step %d: decoding data fragment(s) %s from fragments %s", rb.step,
                     missing, sorted(got))
            for i in missing:
                for c in checks.values():
                    c.forget(i)
            meta["dec"].decode(sorted(got)[:rb.k], missing, wait=False)
        for c in checks.values():
            c.finish()  # every byte of every file checked as it came: nothing is read back
        for w in firsts.values():
            w.finish()
        tl.mark("synced")
        ok = True
    finally:
        if early and not ok:
            meta["dec"].end()
            early[0].join()
        for w in firsts.values():
            w.close()
        engine.close()
        if not ok:
            tier.abort(rb.step)
    for i in got:
        with contextlib.suppress(OSError):  # a data fragment has no scratch file
            os.unlink(os.path.join(part, f".fragment-{i}"))
    return man


def _run_decode(dec: StripeDecoder, use: list[int], missing: list[int], box: list[Any]) -> None:
    """The decode beside the streams (its own thread): ``box`` gets True, False or the error."""
    try:
        box.append(dec.decode(use, missing, wait=True))
    except (ZerostallError, OSError) as exc:
        log.info("zerostall: the decode beside the fetch gave up (%s); it runs again after the fetch", exc)
        box.append(exc)

