"""Restore from peers. Every rank calls :func:`offer` then, before each step the collective load
tries, :func:`fetch`, in the same order (through :mod:`.service`; only the c10d store and
point-to-point connections):

1. what this rank could load: committed local steps holding its node's files, steps whose
   files live peers hold (listed from every other node in parallel), steps on the remote tier;
2. every rank posts, per step, the checkpoint ids it can load it as, and a step is offered only
   where one id is common to every rank (a superseded copy of an overwritten step is never
   restored); the collective load (:mod:`zerostall.distributed.agree`) tries the newest;
3. :func:`fetch`: the node's leader fetches its files from live holders (one thread per file, a
   file cut into ranges across holders, the next holder on a failure), each checked against the
   manifest as it streams in, written with O_DIRECT into ``step-N.partial`` and committed; the
   node's other ranks wait for it. A failed fetch fails that step on every rank through the
   agreement, and all fall back together. A fetch never replaces a committed step's files: into
   a step committed here already only a copy of the same commit goes, beside its own files.
"""

from __future__ import annotations

import contextlib
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
from ..format.manifest import MANIFEST_NAME, Manifest
from ..io.base import Engine
from ..store.local import LocalTier
from . import tombstones
from .exchange import PeerView, ask_peers, in_parallel
from .tcp import TcpTransport
from .verify import StreamCheck, file_entry, ranges

log = logging.getLogger("zerostall")
Holders = dict[str, list[tuple[str, str]]]  # file name -> [(holder node, src node)]


@dataclass(frozen=True)
class Offer:
    """What :func:`offer` found: the steps whose files of this node are local, held whole by live
    holders (the commit every rank loads) or coded, and those the ranks hold as different commits."""

    local: set[int]
    held: dict[int, Holders] = field(default_factory=dict)  # step -> its holders, of the commit in ids
    coded: set[int] = field(default_factory=set)
    ids: dict[int, str] = field(default_factory=dict)  # step -> the commit every rank loads ("": the remote's)
    split: set[int] = field(default_factory=set)
    refs: dict[int, Holders] = field(default_factory=dict)  # every step peers hold (incremental references)
    unshared: set[int] = field(default_factory=set)
    """Steps this node could load that some rank did not offer: counted as this node's, so that
    an error names only the ranks that truly lack a step."""

    def steps(self) -> set[int]:
        return (self.local | set(self.held) | self.coded | self.unshared) - self.split


def _local_steps(tier: LocalTier, view: PeerView, names: list[str]) -> tuple[dict[int, str], dict[int, str | None]]:
    """``(loadable, committed)``: step -> checkpoint id of the local steps holding this node's
    files, and of every committed one (None: its manifest is unreadable)."""
    out: dict[int, str] = {}
    committed: dict[int, str | None] = {}
    for s in tier.listed_steps():
        try:
            man = tier.read_manifest(s)
        except ZerostallError:
            committed[s] = None
            continue
        committed[s] = man.checkpoint_id
        try:
            if man.world_size != view.world:
                continue
            if all(os.path.getsize(os.path.join(tier.step_dir(s), n)) == file_entry(man, n).file_bytes for n in names):
                out[s] = man.checkpoint_id
        except (OSError, ZerostallError):
            continue
    return out, committed


def _peer_holdings(view: PeerView, transport: TcpTransport, names: list[str]) -> dict[int, dict[str, Holders]]:
    """step -> checkpoint id -> file name -> [(holder node, src)] where live peers hold all this node's files."""
    lists = ask_peers(view, transport.list_held, "restore")
    by_step: dict[int, dict[str, dict[str, list[tuple[str, str]]]]] = {}  # step -> ckpt id -> name -> holders
    for node, held in sorted(lists.items()):
        for h in held:
            if not isinstance(h, dict) or not isinstance(h.get("step"), int):
                continue
            if tombstones.dead(view.deleted, h["step"], h.get("checkpoint_id"), h.get("created_unix")):
                continue  # deleted for good (zerostall delete): never restored
            for name in h.get("files", ()):
                if name in names:
                    by_step.setdefault(h["step"], {}).setdefault(str(h.get("checkpoint_id")), {}) \
                        .setdefault(name, []).append((node, str(h.get("src"))))
    out: dict[int, dict[str, Holders]] = {}
    for step, ids in by_step.items():
        for cid, files in ids.items():  # a step overwritten meanwhile: only one copy's files go together
            if all(n in files for n in names):
                out.setdefault(step, {})[cid] = files
    return out


def _offer_ids(store: Store, view: PeerView, load_no: int, offer: dict[int, list[str]],
               timeout_s: float) -> tuple[dict[int, str], set[int]]:
    """Every rank posts, per step, the checkpoint ids it can load it as ("*": any, the remote
    tier's); returns step -> the id common to every rank, and the steps offered as different commits."""
    base = view.key(f"load{load_no}", "ids")
    store.set(f"{base}/r{view.rank}", json.dumps({str(k): v for k, v in offer.items()}))
    keys = [f"{base}/r{r}" for r in range(view.world)]
    if store.poll(keys, time.monotonic() + timeout_s) == "timeout":
        missing = [r for r in range(view.world) if not store.check([keys[r]])]
        raise DistributedError(f"restore: rank(s) {', '.join(map(str, missing))} did not offer the steps they can "
                               f"load within {timeout_s:g} s", missing_ranks=tuple(missing))
    offers = store.multi_get_json(keys)
    if store.add(f"{base}/n", 1) == view.world:
        store.delete(*keys, f"{base}/n")
    common: dict[int, str] = {}
    split: set[int] = set()
    for k in set(offers[0]).intersection(*offers[1:]):
        concrete = [set(o[k]) for o in offers if o[k] != ["*"]]
        ids = set.intersection(*concrete) if concrete else {"*"}
        if ids:
            common[int(k)] = max(ids)
        else:
            split.add(int(k))
    return common, split


def offer(store: Store, view: PeerView, transport: TcpTransport, tier: LocalTier, load_no: int, *,
          step: int | None, remote_steps: list[int], timeout_s: float,
          coded: dict[int, Any] | None = None) -> Offer:
    """Steps 1-2 of the module doc (collective). ``coded``: step -> the checkpoint ids live
    holders can rebuild this node's files of (:func:`.coded_restore.holdings`)."""
    coded = coded or {}
    names = [shard_name(r) for r in view.ranks_of(view.me)]
    local, committed = _local_steps(tier, view, names)
    peers = _peer_holdings(view, transport, names)
    for st in set(peers) & set(committed) - set(local):  # a fetch into a committed step: its own commit only
        peers[st] = {cid: f for cid, f in peers[st].items() if cid == committed[st]}
        if not peers[st]:
            del peers[st]
    remote = set(remote_steps)
    # the remote tier: the commit is not known here ("*")
    mine = {st: [local[st]] if st in local else sorted(set(peers.get(st, ())) | set(coded.get(st, ()))) or ["*"]
            for st in set(local) | set(peers) | set(coded) | remote if step is None or st == step}
    common, split = _offer_ids(store, view, load_no, mine, timeout_s)
    log.info("zerostall: restore: node %s can load steps %s locally, %s from peers, %s from the remote tier",
             view.me, sorted(local)[-5:], sorted(set(peers) | set(coded))[-5:], sorted(remote)[-5:])
    ids = {st: (cid if cid != "*" else "") for st, cid in common.items()}
    held = {st: peers[st][ids[st]] for st in peers if st in ids and ids[st] in peers[st] and st not in local}
    got_coded = {st for st in coded if st in ids and ids[st] in coded[st] and st not in local and st not in held}
    refs = {st: cids[max(cids)] for st, cids in peers.items()}
    unshared = set(mine) - set(common) - split
    return Offer(set(local), held, got_coded, ids, split, refs, unshared)


def fetch(store: Store, view: PeerView, got: Offer, step: int, load_no: int, timeout_s: float,
          files_in: Callable[[], None]) -> bool:
    """Step 3: the node's leader brings ``step``'s files of this node in (``files_in``: whole
    copies, :func:`fetch_files`, or the rebuild from coded fragments); the others wait. Returns
    whether it fetched. Raises :class:`CheckpointNotFound` on every rank of the node when the fetch failed."""
    if step in got.local or (step not in got.held and step not in got.coded):
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
        files_in()
    except BaseException as exc:
        store.set(key, json.dumps({"ok": False, "error": str(exc)}))
        if isinstance(exc, ZerostallError) and not isinstance(exc, CheckpointNotFound):
            raise CheckpointNotFound(f"restore of step {step} from peers failed on node {view.me}: {exc}") from exc
        raise
    store.set(key, json.dumps({"ok": True}))
    got.local.add(step)
    return True


def fetch_files(view: PeerView, transport: TcpTransport, tier: LocalTier, engine_for: Callable[[], Engine],
                 step: int, got: Offer) -> None:
    """``step``'s files of this node (the agreed commit's), and those of the steps it references."""
    names = [shard_name(r) for r in view.ranks_of(view.me)]
    man = _fetch_step(view, transport, tier, engine_for, step, got.held[step], names, got.ids.get(step, ""))

    def bring(ref: int) -> Manifest:
        if ref not in got.refs:
            raise CheckpointNotFound(f"restore of step {step}: it references step {ref}, of which no "
                                     f"live node holds {', '.join(names)}")
        log.info("zerostall: restore of step %d: fetching step %d, whose bytes it references", step, ref)
        return _fetch_step(view, transport, tier, engine_for, ref, got.refs[ref], names)
    commit_with_refs(tier, step, man, names, bring)


def commit_with_refs(tier: LocalTier, step: int, man: Manifest, names: list[str],
                     bring: Callable[[int], Manifest]) -> None:
    """``step``'s files ``names`` are in ``step-N.partial``: each step they reference that is not
    local is brought into its own partial directory (``bring(ref)`` returns its manifest) and
    committed, then ``step``; on a failure ``step``'s partial directory goes."""
    try:
        for ref in sorted({r.step for r in man.ref_files if r.name in names}):
            if ref not in tier.steps() or not all(os.path.exists(os.path.join(tier.step_dir(ref), r.name))
                                                  for r in man.ref_files if r.step == ref and r.name in names):
                commit_fetched(tier, ref, bring(ref))
    except BaseException:
        tier.abort(step)
        raise
    commit_fetched(tier, step, man)


def commit_fetched(tier: LocalTier, step: int, man: Manifest) -> None:
    """Commit the fetched ``step-N.partial``. Into a step committed here only the same commit
    goes, and its files not fetched stay (linked in before the overwrite)."""
    if step not in tier.listed_steps():
        tier.commit(step, man)
        return
    try:
        here = tier.read_manifest(step).checkpoint_id
    except ZerostallError:
        here = None
    if here != man.checkpoint_id:
        tier.abort(step)
        raise CheckpointNotFound(f"restore of step {step}: {tier.root!r} holds another commit of step {step} "
                                 f"({here or 'its manifest unreadable'}, the peers' is {man.checkpoint_id}); a fetch "
                                 "never replaces a committed step")
    part, final = tier.partial_dir(step), tier.step_dir(step)
    for name in os.listdir(final):
        src, dst = os.path.join(final, name), os.path.join(part, name)
        if name != MANIFEST_NAME and not os.path.lexists(dst) and os.path.isfile(src) and not os.path.islink(src):
            os.link(src, dst)
    tier.commit(step, man, overwrite=True)


RANGE_MIN_BYTES = 32 << 20  # a file is split across holders only into ranges this large (fewer connections)


def _fetch_file(view: PeerView, transport: TcpTransport, engine_for: Callable[[], Engine], step: int,
                name: str, hs: list[tuple[str, str]], path: str, checkpoint_id: str = "") -> Manifest:
    """One file of ``step`` into ``path`` from the holders ``hs`` (in order of preference),
    verified, fdatasync'ed; returns the step's manifest. With several holders the file is cut
    into ranges (:func:`.verify.ranges`) fetched in parallel, a failed one again from the next
    holder. ``checkpoint_id``: the commit the copy must belong to."""

    def same_commit(m: Manifest, node: str) -> Manifest:
        if checkpoint_id and m.checkpoint_id != checkpoint_id:
            raise ZerostallError(f"node {node} holds another commit of step {step} ({m.checkpoint_id}, not the "
                                 f"agreed {checkpoint_id})")
        return m
    errors: list[str] = []
    man: Manifest | None = None
    live = list(hs)
    if len(hs) > 1:  # the manifest first: it says where the file may be cut
        for node, src in hs:
            got: list[Manifest] = []

            def probe(m: Manifest, size: int, node: str = node) -> tuple[Any, Any]:
                got.append(same_commit(m, node))
                return None, StreamCheck(m, name, f"{node}:{src}/step-{step}/{name}", 0, 0)  # no bytes
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

            def sink(m: Manifest, size: int, node: str = node) -> tuple[Any, StreamCheck]:
                same_commit(m, node)
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
                    with contextlib.suppress(OSError):
                        os.unlink(path)
            finally:
                for w in opened:
                    w.close()

    try:
        in_parallel(one, [(k,) for k in range(len(rngs))], "zerostall-peers-fetch")
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


def _fetch_step(view: PeerView, transport: TcpTransport, tier: LocalTier, engine_for: Callable[[], Engine],
                step: int, holders: dict[str, list[tuple[str, str]]], names: list[str],
                checkpoint_id: str = "") -> Manifest:
    """Bring ``names`` of ``step`` into ``step-N.partial`` in parallel; returns its manifest."""
    part = tier.begin(step)
    mans: dict[str, Manifest] = {}
    errors: dict[str, str] = {}

    def one(name: str, i: int) -> None:
        hs = holders.get(name, [])
        hs = hs[i % len(hs):] + hs[:i % len(hs)] if hs else []  # files spread over holders
        path = os.path.join(part, name)
        try:
            mans[name] = _fetch_file(view, transport, engine_for, step, name, hs, path, checkpoint_id)
        except (ZerostallError, OSError) as exc:
            errors[name] = str(exc)
            with contextlib.suppress(OSError):
                os.unlink(path)

    in_parallel(one, [(n, i) for i, n in enumerate(names)])
    missing = [n for n in names if n not in mans]
    if missing:
        tier.abort(step)
        raise CheckpointNotFound(f"restore of step {step}: {', '.join(f'{n} ({errors.get(n)})' for n in missing)}")
    if len({m.checkpoint_id for m in mans.values()}) > 1:
        tier.abort(step)
        raise CheckpointNotFound(f"restore of step {step}: the holders hold files of different checkpoints")
    return next(iter(mans.values()))
