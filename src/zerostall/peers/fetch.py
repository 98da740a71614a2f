"""Restore from peers: what this node could load counting what live peers hold, and bringing
this node's files of a step into the local root before the ordinary load reads them.

Called by ``Checkpointer.load`` on the caller's thread of every rank (every rank calls it, in
the same order; it talks only through the c10d store and point-to-point connections):

1. :func:`offer`: what this rank could load -- committed local steps holding its node's
   files; steps whose files (each of this node's ranks' ``rank-R.shard``) some live peer
   holds, one checkpoint id (listed from every other node in parallel; a dead or stopped node
   is skipped after ``peers.timeout_s``). The collective load (:mod:`zerostall.distributed.agree`)
   adds them to the steps it offers, with the local and remote ones;
2. for each step the ranks agree to try, newest first, :func:`fetch` (before the step is
   loaded, on every rank): if this node lacks the step, its leader fetches the files from live
   holders (one thread per file, spread over the holders, the next one on a failure), each
   checked byte by byte against the manifest while it streams in, written with O_DIRECT into
   ``step-N.partial`` and committed; the other ranks of the node wait for it
   (``load<k>/node/<node>/s<N>``). A fetch that fails (no live holder, a flipped byte from the
   only one) fails that step on this rank like any defect of it: every rank hears it through
   the agreement and all fall back to the next step together, which the holders may still
   hold for this node. Only when no live node holds a file is the remote tier used (the
   ordinary load downloads it), and the log says which tier served each file.
"""

from __future__ import annotations

import json
import logging
import os
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable

from ..distributed.store import Store
from ..errors import CheckpointNotFound, DistributedError, ZerostallError
from ..format.layout import shard_name
from ..format.manifest import Manifest
from ..io.base import Engine
from ..store.tier import RootTier
from .exchange import PeerView
from .transport import Transport
from .verify import StreamCheck, file_entry, ranges

log = logging.getLogger("zerostall")


@dataclass(frozen=True)
class Offer:
    """What :func:`offer` found: the steps whose files of this node are local, and every step
    live peers hold them of (an incremental step's references too)."""

    local: set[int]
    held: dict[int, dict[str, list[tuple[str, str]]]] = field(default_factory=dict)
    """step -> file name -> [(holder node, src node)]"""
    coded: set[int] = field(default_factory=set)
    """Steps live holders keep enough coded fragments of to rebuild this node's files."""

    def steps(self) -> set[int]:
        return self.local | set(self.held) | self.coded


def _local_steps(tier: RootTier, view: PeerView, names: list[str]) -> set[int]:
    out = set()
    for s in tier.steps():
        try:
            man = tier.read_manifest(s)
            if man.world_size != view.world:
                continue
            if all(os.path.getsize(os.path.join(tier.step_dir(s), n)) == file_entry(man, n).file_bytes for n in names):
                out.add(s)
        except (OSError, ZerostallError):
            continue
    return out


Holders = dict[str, list[tuple[str, str]]]
"""file name -> [(holder node, src node)]"""


def _peer_holdings(view: PeerView, transport: Transport, names: list[str]) -> dict[int, Holders]:
    """step -> file name -> [(holder node, src)] for this node's files, from every live peer."""
    lists: dict[str, list[dict[str, Any]]] = {}

    def ask(node: str) -> None:
        try:
            lists[node] = transport.list_held(view.endpoints[node])
        except (ZerostallError, OSError) as exc:
            log.warning("zerostall: restore: node %s is not reachable (%s); its copies are not counted", node, exc)

    threads = [threading.Thread(target=ask, args=(n,), daemon=True) for n in view.endpoints if n != view.me]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    by_step: dict[int, dict[str, dict[str, list[tuple[str, str]]]]] = {}  # step -> ckpt id -> name -> holders
    for node, held in sorted(lists.items()):
        for h in held:
            if not isinstance(h, dict) or not isinstance(h.get("step"), int):
                continue
            for name in h.get("files", ()):
                if name in names:
                    by_step.setdefault(h["step"], {}).setdefault(str(h.get("checkpoint_id")), {}) \
                        .setdefault(name, []).append((node, str(h.get("src"))))
    out = {}
    for step, ids in by_step.items():
        for files in ids.values():  # a step overwritten meanwhile: only one copy's files go together
            if all(n in files for n in names):
                out[step] = files
                break
    return out


def offer(view: PeerView, transport: Transport, tier: RootTier, coded: set[int] = frozenset()) -> Offer:
    """Step 1 of the module doc (caller's thread). ``coded``: the steps live holders hold
    enough fragments of to rebuild this node's files (:func:`.coded_restore.holdings`)."""
    names = [shard_name(r) for r in view.ranks_of(view.me)]
    local = _local_steps(tier, view, names)
    peers = _peer_holdings(view, transport, names)
    log.info("zerostall: restore: node %s can load steps %s locally, %s from peers", view.me, sorted(local)[-5:],
             sorted(set(peers) | set(coded))[-5:])
    return Offer(local, peers, set(coded) - local - set(peers))


def fetch(store: Store, view: PeerView, transport: Transport, tier: RootTier, engine_for: Callable[[], Engine],
          got: Offer, step: int, load_no: int, timeout_s: float, files_in: Callable[[], None] | None = None) -> bool:
    """Step 2: the node's leader brings ``step``'s files of this node in (from the holders of
    whole copies; for a step only coded fragments cover, ``files_in``: the rebuild); the others
    wait. Returns whether it fetched (False: the files are local, or no peer holds them).
    Raises :class:`CheckpointNotFound` on every rank of the node when the fetch failed."""
    if step in got.local or (step not in got.held and (step not in got.coded or files_in is None)):
        return False
    key = view.key(f"load{load_no}", "node", view.me, f"s{step}")
    if not view.leader:
        if store.poll([key], time.monotonic() + timeout_s) == "timeout":
            raise DistributedError(f"restore: the leader of node {view.me} did not fetch step {step} within "
                                   f"{timeout_s:g} s")
        res = store.get_json(key)
        if not res.get("ok"):
            raise CheckpointNotFound(f"restore of step {step} from peers failed on node {view.me}: {res['error']}")
        return True
    try:
        if files_in is not None and step not in got.held:
            files_in()
        else:
            _fetch_files(view, transport, tier, engine_for, step, got.held[step], got.held)
    except BaseException as exc:
        store.set(key, json.dumps({"ok": False, "error": str(exc)}))
        if isinstance(exc, ZerostallError) and not isinstance(exc, CheckpointNotFound):
            raise CheckpointNotFound(f"restore of step {step} from peers failed on node {view.me}: {exc}") from exc
        raise
    store.set(key, json.dumps({"ok": True}))
    got.local.add(step)
    return True


def _fetch_files(view: PeerView, transport: Transport, tier: RootTier, engine_for: Callable[[], Engine],
                 step: int, holders: Holders, held: dict[int, Holders]) -> None:
    """``step``'s files of this node, and first those of earlier steps it references
    (incremental: the bytes it borrows travel with their own step) that are not local."""
    names = [shard_name(r) for r in view.ranks_of(view.me)]
    man = _fetch_step(view, transport, tier, engine_for, step, holders, names, commit=False)
    try:
        for ref in sorted({r.step for r in man.ref_files if r.name in names}):
            if ref in tier.steps() and all(os.path.exists(os.path.join(tier.step_dir(ref), r.name))
                                           for r in man.ref_files if r.step == ref and r.name in names):
                continue
            if ref not in held:
                raise CheckpointNotFound(f"restore of step {step}: it references step {ref}, of which no "
                                         f"live node holds {', '.join(names)}")
            log.info("zerostall: restore of step %d: fetching step %d, whose bytes it references", step, ref)
            _fetch_step(view, transport, tier, engine_for, ref, held[ref], names, commit=True)
    except BaseException:
        tier.abort(step)
        raise
    tier.commit(step, man, overwrite=step in tier.listed_steps())


RANGE_MIN_BYTES = 32 << 20
"""A file is split across holders only into ranges at least this large (smaller ones cost more
in connections than they save)."""


class _ManifestOnly:
    """A sink check for a zero-byte range: the get only brings the step's manifest."""

    def feed(self, mv: memoryview) -> None:
        raise ZerostallError("a zero-byte range received bytes")

    def digest(self) -> str:
        return ""


def _fetch_file(view: PeerView, transport: Transport, engine_for: Callable[[], Engine], step: int,
                name: str, hs: list[tuple[str, str]], path: str) -> Manifest:
    """One file of ``step`` into ``path`` from the holders ``hs`` (in order of preference),
    verified, fdatasync'ed; returns the step's manifest. With two or more live holders the file
    is cut into ranges at tensor boundaries (:func:`.verify.ranges`), one per holder, fetched
    in parallel, each checked against the manifest's crc32c as it streams in; a range whose
    holder fails is fetched again from the next holder (only that range). One holder: the
    whole file in one stream."""
    errors: list[str] = []
    man: Manifest | None = None
    live = list(hs)
    if len(hs) > 1:  # the manifest first: it says where the file may be cut
        for node, src in hs:
            got: list[Manifest] = []

            def probe(m: Manifest, size: int) -> tuple[Any, Any]:
                got.append(m)
                return None, _ManifestOnly()
            try:
                transport.get(view.endpoints[node], src, step, name, probe, rng=(0, 0))
                man = got[0]
                break
            except (ZerostallError, OSError) as exc:
                log.warning("zerostall: restore of step %d: node %s did not send %s's manifest: %s", step, node,
                            name, exc)
                errors.append(f"{node}: {exc}")
                live.remove((node, src))
    if not live:
        raise CheckpointNotFound("; ".join(errors) or "no live holder")
    rngs: list[tuple[int, int] | None] = [None]
    if man is not None:
        rngs = list(ranges(man, name, len(live), RANGE_MIN_BYTES))
    engine = engine_for()
    first: Any = None  # the file's first writer: creates it; fdatasync'ed once every range is in
    if man is not None and len(rngs) > 1:
        first = engine.open_write(path, file_entry(man, name).file_bytes)
    done: dict[int, Manifest] = {}
    mu = threading.Lock()

    def one(k: int) -> None:
        rng = rngs[k]
        for node, src in live[k % len(live):] + live[:k % len(live)]:
            opened: list[Any] = []
            got: list[Manifest] = []

            def sink(m: Manifest, size: int) -> tuple[Any, StreamCheck]:
                w = engine.open_write(path, size) if first is None else engine.open_update(path)
                opened.append(w)
                got.append(m)
                a, b = rng if rng is not None else (0, size)
                return w, StreamCheck(m, name, f"{node}:{src}/step-{step}/{name}", a, b)
            what = name if rng is None else f"{name} bytes {rng[0]}..{rng[1]}"
            t0 = time.perf_counter()
            try:
                transport.get(view.endpoints[node], src, step, name, sink, rng=rng)
                if first is None:
                    opened[0].finish()
                with mu:
                    done[k] = got[0]
                n = (rng[1] - rng[0]) if rng is not None else os.path.getsize(path)
                log.info("zerostall: restore of step %d: %s served by peer %s (%.1f MB in %.2f s)", step, what, node,
                         n / 1e6, time.perf_counter() - t0)
                return
            except (ZerostallError, OSError) as exc:
                log.warning("zerostall: restore of step %d: fetching %s from node %s failed: %s", step, what, node,
                            exc)
                with mu:
                    errors.append(f"{node}: {exc}")
                if first is None:
                    try:
                        os.unlink(path)
                    except OSError:
                        pass
            finally:
                for w in opened:
                    w.close()

    try:
        threads = [threading.Thread(target=one, args=(k,), name="zerostall-peers-fetch", daemon=True)
                   for k in range(len(rngs))]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        if len(done) < len(rngs):
            raise CheckpointNotFound("; ".join(errors) or "no live holder")
        if len({m.checkpoint_id for m in done.values()} | ({man.checkpoint_id} if man is not None else set())) > 1:
            raise CheckpointNotFound("the holders sent ranges of different checkpoints (the step was overwritten)")
        if first is not None:
            first.finish()
    finally:
        if first is not None:
            first.close()
        engine.close()
    return man if man is not None else done[0]


def _fetch_step(view: PeerView, transport: Transport, tier: RootTier, engine_for: Callable[[], Engine],
                step: int, holders: dict[str, list[tuple[str, str]]], names: list[str], *, commit: bool) -> Manifest:
    """Bring ``names`` of ``step`` into ``step-N.partial`` (verified; the files in parallel,
    each from its holders: :func:`_fetch_file`); commit it when asked. Returns the step's manifest."""
    part = tier.begin(step)
    mans: dict[str, Manifest] = {}
    errors: dict[str, str] = {}

    def one(name: str, i: int) -> None:
        hs = holders.get(name, [])
        hs = hs[i % len(hs):] + hs[:i % len(hs)] if hs else []  # files spread over holders
        path = os.path.join(part, name)
        try:
            mans[name] = _fetch_file(view, transport, engine_for, step, name, hs, path)
        except (ZerostallError, OSError) as exc:
            errors[name] = str(exc)
            try:
                os.unlink(path)
            except OSError:
                pass

    threads = [threading.Thread(target=one, args=(n, i), daemon=True) for i, n in enumerate(names)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    missing = [n for n in names if n not in mans]
    if missing:
        tier.abort(step)
        raise CheckpointNotFound(f"restore of step {step}: {', '.join(f'{n} ({errors.get(n)})' for n in missing)}")
    if len({m.checkpoint_id for m in mans.values()}) > 1:
        tier.abort(step)
        raise CheckpointNotFound(f"restore of step {step}: the holders hold files of different checkpoints")
    man = next(iter(mans.values()))
    if commit:
        tier.commit(step, man, overwrite=step in tier.listed_steps())
    return man
