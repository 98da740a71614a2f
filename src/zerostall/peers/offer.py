"""Restore from peers, steps 1-2 (step 3, bringing the files in, is :mod:`.fetch`). Every rank
calls :func:`offer` in the same order (through :mod:`.service`; only the c10d store and
point-to-point connections):

1. what this rank could load: committed local steps holding its node's files, steps whose
   files live peers hold (listed from every other node in parallel), steps on the remote tier;
2. every rank posts, per step, the checkpoint ids it can load it as, and a step is offered only
   where one id is common to every rank (a superseded copy of an overwritten step is never
   restored); the collective load (:mod:`zerostall.distributed.agree`) tries the newest.
"""

from __future__ import annotations

import json
import logging
import os
import time
from dataclasses import dataclass, field
from typing import Any

from ..distributed.store import Store
from ..errors import DistributedError, ZerostallError
from ..format.layout import shard_name
from ..store.tier import RootTier
from . import tombstones
from .exchange import PeerView, ask_peers
from .tcp import TcpTransport
from .verify import file_entry

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


def _local_steps(tier: RootTier, view: PeerView, names: list[str]) -> tuple[dict[int, str], dict[int, str | None]]:
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


def offer(store: Store, view: PeerView, transport: TcpTransport, tier: RootTier, load_no: int, *,
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
