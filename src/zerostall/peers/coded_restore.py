"""Coded copies, the restore side: which steps live holders can rebuild this node's files of
(:func:`holdings`), and the rebuild itself (:func:`rebuild`).

Called through :meth:`zerostall.peers.service.PeerLoad.prepare` on the caller's thread of every rank:
:func:`holdings` before the ranks' agreement (a step counts once live nodes hold k distinct
fragments of one coding of it), :func:`rebuild` on the node's leader when the agreed step is
neither local nor otherwise at hand (:func:`.fetch.fetch` runs it and tells the node's other
ranks the outcome).

The rebuild, into ``step-N.partial`` of the local root:

1. k fetch threads, fragments in index order (data fragments first, so nothing is decoded
   while their holders live), each fragment from one holder, the next holder of the same
   fragment -- or the next fragment -- when one fails, stops (``peers.timeout_s``) or sends a
   byte that does not match the fragment's crc32c (checked as it streams in; a data fragment
   goes straight into the node's files at its offsets with O_DIRECT, a parity fragment into a
   ``.fragment-<i>`` scratch file);
2. the data fragments that did not come are decoded stripe by stripe from the k that did and
   written into the files; every file is fdatasync'ed;
3. every file is read back through :class:`.verify.StreamCheck` (each tensor's crc32c, the
   header, zero padding), as a local copy's load would check it, the kernel asked to read two
   pieces ahead (``POSIX_FADV_WILLNEED``: the disk reads while the CPU checks); the scratch
   files go, and the step is committed (incremental steps: the steps it references first).
"""

from __future__ import annotations

import logging
import mmap
import os
import threading
from dataclasses import dataclass, field
from typing import Any, Callable

from ..errors import CheckpointNotFound, CorruptCheckpoint, ZerostallError
from ..format.layout import shard_name
from ..format.manifest import Manifest
from ..io.base import Engine
from ..store.tier import RootTier
from . import tombstones
from .coding import Code, Layout
from .exchange import PeerView
from .fetch import commit_fetched
from .fragments import FragmentCheck, download, list_fragments
from .verify import StreamCheck

__all__ = ["Rebuild", "holdings", "rebuild"]
log = logging.getLogger("zerostall")
READ_BYTES = 16 << 20


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
    """step -> checkpoint id -> :class:`Rebuild` for every commit of a step of this node of
    which live nodes hold at least k fragments of one coding (every other node asked in
    parallel; an unreachable one is skipped after ``peers.timeout_s``). Every commit is kept:
    holders may still keep a superseded commit of an overwritten step, and only the ranks'
    agreement says which one the step is."""
    lists: dict[str, list[dict[str, Any]]] = {}

    def ask(node: str) -> None:
        try:
            lists[node] = list_fragments(transport, view.endpoints[node], view.me)
        except (ZerostallError, OSError) as exc:
            log.warning("zerostall: restore: node %s did not list its fragments (%s); they are not counted", node,
                        exc)
    threads = [threading.Thread(target=ask, args=(n,), daemon=True) for n in view.endpoints if n != view.me]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
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
                                 f"{checkpoint_id or '(any)'}" + (f" (only of {', '.join(sorted(ids))})" if ids else ""))
    return max(ids.values(), key=lambda r: len(r.holders))


class _ConcatWriter:
    """Writes data fragment ``index``'s bytes (fragment offsets) into the node's files at
    their own offsets; padding must be zero. One fetch thread; :meth:`close` always."""

    def __init__(self, engine: Engine, lay: Layout, part: str, index: int, where: str):
        self.engine, self.lay, self.part, self.index, self.where = engine, lay, part, index, where
        self._open: dict[str, Any] = {}

    def write(self, extents: list[tuple[int, memoryview]], overlap: Callable[[], None] | None = None) -> None:
        for off, mv in extents:
            for name, foff, at, n in self.lay.pieces(self.index, off, len(mv)):
                piece = mv[at - off:at - off + n]
                if name is None:
                    if bytes(piece).count(0) != n:
                        raise CorruptCheckpoint(f"{self.where}: non-zero padding", path=self.where)
                    continue
                if name not in self._open:
                    self._open[name] = self.engine.open_update(os.path.join(self.part, name))
                self._open[name].write([(foff, piece)])
        if overlap is not None:
            overlap()

    def close(self) -> None:
        for w in self._open.values():
            w.close()


def rebuild(view: PeerView, transport: Any, tier: RootTier, engine_for: Callable[[], Engine], step: int,
            coded: dict[int, dict[str, Rebuild]], checkpoint_id: str = "") -> None:
    """The module doc's steps 1-3 for ``step`` (and the earlier steps it references).
    ``checkpoint_id``: the commit of the step the ranks agreed on (a referenced step's commit
    is the one its reference names)."""
    names = [shard_name(r) for r in view.ranks_of(view.me)]
    man = _rebuild_step(view, transport, tier, engine_for, _pick(coded, step, checkpoint_id), names, commit=False)
    try:
        for ref in sorted({r.step for r in man.ref_files if r.name in names}):
            if ref in tier.steps() and all(os.path.exists(os.path.join(tier.step_dir(ref), r.name))
                                           for r in man.ref_files if r.step == ref and r.name in names):
                continue
            ref_ids = {r.file_id for r in man.ref_files if r.step == ref and r.name in names}
            if ref not in coded or len(ref_ids) != 1:
                raise CheckpointNotFound(f"restore of step {step}: it references step {ref}, of which live nodes "
                                         f"hold fewer than k fragments of {', '.join(names)}")
            _rebuild_step(view, transport, tier, engine_for, _pick(coded, ref, ref_ids.pop()), names, commit=True)
    except BaseException:
        tier.abort(step)
        raise
    commit_fetched(tier, step, man)  # never drops a committed step's own files


def _rebuild_step(view: PeerView, transport: Any, tier: RootTier, engine_for: Callable[[], Engine], rb: Rebuild,
                  names: list[str], *, commit: bool) -> Manifest:
    part = tier.begin(rb.step)
    engine = engine_for()
    mu = threading.Lock()
    got: dict[int, str] = {}  # index -> where from
    errors: list[str] = []
    pending = sorted(rb.holders)  # data fragments first
    meta: dict[str, Any] = {}
    firsts: dict[str, Any] = {}  # each file's creating writer: fdatasync'ed once all is in

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
                meta.update(lay=lay, man=man, desc=desc)
            elif desc != meta["desc"]:
                raise CorruptCheckpoint(f"{where}: a fragment of another coding of the step", path=where)
            return meta["lay"]

    def one_fragment(i: int, node: str) -> None:
        where = f"{node}:{view.me}/step-{rb.step}/fragment-{i}"
        opened: list[Any] = []

        def sink(man_bytes: bytes, desc: bytes, head: dict[str, Any]) -> tuple[Any, FragmentCheck]:
            lay = setup(man_bytes, desc, where)
            if i < lay.k:
                w: Any = _ConcatWriter(engine, lay, part, i, where)
            else:
                w = engine.open_write(os.path.join(part, f".fragment-{i}"), lay.fragment_bytes)
            opened.append(w)
            return w, FragmentCheck()
        try:
            download(transport, view.endpoints[node], view.me, rb.step, i, sink)
            if i >= rb.k:
                opened[0].finish()
        except BaseException:
            if i >= rb.k:
                _unlink(os.path.join(part, f".fragment-{i}"))
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

    try:
        threads = [threading.Thread(target=worker, name="zerostall-peers-fragment", daemon=True)
                   for _ in range(rb.k)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        if len(got) < rb.k:
            raise CheckpointNotFound(f"restore of step {rb.step}: {len(got)} of the {rb.k} fragments needed came "
                                     f"in ({'; '.join(errors) or 'no live holder'})")
        lay, man = meta["lay"], meta["man"]
        missing = [i for i in range(rb.k) if i not in got]
        if missing:
            log.info("zerostall: restore of step %d: decoding data fragment(s) %s from fragments %s", rb.step,
                     missing, sorted(got))
            _decode(engine, lay, part, sorted(got)[:rb.k], missing)
        for w in firsts.values():
            w.finish()
        for name, _ in lay.files:
            _verify(man, os.path.join(part, name), f"step {rb.step} {name} rebuilt from fragments")
    except BaseException:
        for w in firsts.values():
            w.close()
        engine.close()
        tier.abort(rb.step)
        raise
    for w in firsts.values():
        w.close()
    engine.close()
    for i in got:
        _unlink(os.path.join(part, f".fragment-{i}"))
    if commit:
        commit_fetched(tier, rb.step, man)
    return man


def _decode(engine: Engine, lay: Layout, part: str, use: list[int], missing: list[int]) -> None:
    """Data fragments ``missing`` from fragments ``use`` (k of them, in ``part``), stripe by stripe."""
    code = Code(lay.k, lay.m)
    bufs = {i: mmap.mmap(-1, lay.fragment_bytes if lay.fragment_bytes < READ_BYTES else READ_BYTES) for i in use}
    out = mmap.mmap(-1, len(next(iter(bufs.values()))))
    fds: dict[str, int] = {}
    writers: dict[str, Any] = {}
    try:
        for name, _ in lay.files:
            fds[name] = os.open(os.path.join(part, name), os.O_RDONLY | os.O_CLOEXEC)
        for i in use:
            if i >= lay.k:
                fds[f".fragment-{i}"] = os.open(os.path.join(part, f".fragment-{i}"), os.O_RDONLY | os.O_CLOEXEC)
        step = len(out)
        for off in range(0, lay.fragment_bytes, step):
            n = min(step, lay.fragment_bytes - off)
            blocks: dict[int, Any] = {}
            for i in use:
                mv = memoryview(bufs[i])[:n]
                if i < lay.k:
                    for name, foff, at, ln in lay.pieces(i, off, n):
                        dst = mv[at - off:at - off + ln]
                        if name is None:
                            dst[:] = bytes(ln)
                        else:
                            _pread(fds[name], dst, foff)
                else:
                    _pread(fds[f".fragment-{i}"], mv, off)
                blocks[i] = mv
            for i, data in code.recover(blocks, missing).items():
                omv = memoryview(out)[:n]
                omv[:] = data
                for name, foff, at, ln in lay.pieces(i, off, n):
                    if name is None:
                        continue
                    if name not in writers:
                        writers[name] = engine.open_update(os.path.join(part, name))
                    writers[name].write([(foff, omv[at - off:at - off + ln])])
            del blocks
    finally:
        for w in writers.values():
            w.close()
        for fd in fds.values():
            os.close(fd)


def _pread(fd: int, mv: memoryview, off: int) -> None:
    got = 0
    while got < len(mv):
        r = os.preadv(fd, [mv[got:]], off + got)
        if r <= 0:
            raise CorruptCheckpoint(f"short read at offset {off + got} while decoding")
        got += r


def _verify(man: Manifest, path: str, where: str) -> None:
    check = StreamCheck(man, os.path.basename(path), where)
    size = os.path.getsize(path)
    buf = bytearray(min(READ_BYTES, max(size, 1)))
    with open(path, "rb", buffering=0) as f:
        off = ahead = 0
        while off < size:
            if ahead < min(size, off + 2 * len(buf)):  # the kernel reads the next pieces while this
                nxt = min(size, off + 3 * len(buf))  # one is checked (the file was written O_DIRECT: uncached)
                try:
                    os.posix_fadvise(f.fileno(), ahead, nxt - ahead, os.POSIX_FADV_WILLNEED)
                except OSError:
                    pass
                ahead = nxt
            n = f.readinto(memoryview(buf)[:min(len(buf), size - off)])
            if not n:
                raise CorruptCheckpoint(f"{where}: short read at {off}", path=path)
            check.feed(memoryview(buf)[:n])
            off += n
        try:
            os.posix_fadvise(f.fileno(), 0, 0, os.POSIX_FADV_DONTNEED)
        except OSError:
            pass
    check.digest()


def _unlink(path: str) -> None:
    try:
        os.unlink(path)
    except OSError:
        pass
