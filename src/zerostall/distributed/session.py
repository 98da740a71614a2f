"""The start-up round every collective ``Checkpointer`` runs: joining the ranks of one root and
finding where its copies are (docs/distributed.md).

``Checkpointer.__init__`` (caller's thread) calls :func:`join` once; the commit rounds use the
returned :class:`Session` from the persist thread. Ranks that see each other's probe files
(``.zerostall-probe-<nonce>``) share a *copy* (group ``g<leader>``, its lowest rank the
leader). Keys live under a namespace hashed from the root's absolute path (or ``dist_name``),
never a per-process counter. The round:

1. every rank creates its probe file; ranks ``r > 0`` set ``<ns>/join/r<r>`` = ``{nonce, node}``;
2. rank 0 waits for every join key (``join_timeout_s``), publishes ``<ns>/<sid>/probes``
   (every nonce) and answers ``<ns>/welcome/r<r>`` = ``{nonce, sid}`` (or ``{nonce, error}``:
   a rank is missing, all fail at once); a welcome with another nonce is stale and skipped;
3. under ``<ns>/<sid>`` every rank reports whose probes it sees (``sees/r<r>``); rank 0 forms
   the groups (or refuses the view), owns a shared root (``LocalTier.own``: lock, recovery) and
   publishes ``ready`` = ``{groups, nodes}`` (or ``error``);
4. with several copies each leader owns its copy and sets ``cleaned/r<leader>`` (or the error);
   every rank waits for all: a root not taken fails every rank now (:class:`RootLockedError`);
5. every rank removes its probe and adds 1 to ``setup_ack``; the last deletes the keys.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import time
import uuid
from dataclasses import dataclass
from typing import Any

from ..errors import ConfigError, DistributedError, RootLockedError, ZerostallError
from ..store.local import LocalTier
from .node import node_id
from .store import Store

LOCAL_HINT = ("every rank must create the same Checkpointer (same path or dist_name); a process that "
              "saves alone (rank-0-only saving, tools) needs dist_mode='local'")
PROBE_PREFIX = ".zerostall-probe-"


def namespace(root: str, name: str | None = None) -> str:
    """The store namespace of a checkpoint root: agreed by every rank without a counter."""
    src = name if name is not None else os.path.abspath(root)
    return "zerostall/" + hashlib.sha256(src.encode()).hexdigest()[:16]


@dataclass(frozen=True)
class Session:
    """What the ranks agreed at start-up; ``prefix`` scopes every later key. Any thread."""

    prefix: str
    rank: int
    world: int
    node_local: bool
    """More than one copy of the root."""
    leaders: tuple[int, ...]
    """Each copy's leader, ascending (they own a copy and run retention)."""
    groups: tuple[str, ...]
    """The copies' names (``g<leader>``), in ``leaders`` order."""
    group: str
    """This rank's copy."""
    node: str = ""
    """This rank's :func:`~.node.node_id`."""
    members: tuple[int, ...] = ()
    """The ranks that share this rank's copy, ascending (``members[0]`` is its leader)."""
    nodes: tuple[str, ...] = ()
    """Every rank's node id, by rank."""
    leader_of: tuple[int, ...] = ()
    """Every rank's copy, as its leader's rank, by rank."""

    def copies(self) -> list[tuple[int, ...]]:
        """The ranks of each copy, in ``leaders`` order (one copy of everybody if unknown)."""
        if not self.leader_of:
            return [tuple(range(self.world))]
        return [tuple(r for r in range(self.world) if self.leader_of[r] == L) for L in self.leaders]

    @property
    def leader(self) -> int:
        return self.members[0] if self.members else 0

    @property
    def is_leader(self) -> bool:
        return self.rank == self.leader


def join(store: Store, ns: str, rank: int, world: int, tier: LocalTier, timeout_s: float) -> Session:
    """The start-up round. Raises :class:`DistributedError` naming the ranks that did not join
    in time, :class:`ConfigError` (an inconsistent view), :class:`RootLockedError`."""
    nonce = uuid.uuid4().hex
    probe = os.path.join(tier.root, PROBE_PREFIX + nonce)
    open(probe, "w").close()
    try:
        return _join(store, ns, rank, world, tier, timeout_s, node_id(), nonce)
    finally:
        with contextlib.suppress(OSError):
            os.unlink(probe)


def _join(store: Store, ns: str, rank: int, world: int, tier: LocalTier, timeout_s: float, node: str,
          nonce: str) -> Session:
    deadline = time.monotonic() + timeout_s
    if rank == 0:
        sid = uuid.uuid4().hex[:16]
        _welcome(store, ns, world, sid, nonce, node, deadline, timeout_s, tier.root)
        return _decide(store, f"{ns}/{sid}", world, node, tier, timeout_s)
    # a grace past rank 0's deadline: a rank withdrawing its join key while rank 0 reads it
    # would be reported missing
    deadline += min(max(2.0, timeout_s / 2), 30.0)
    store.set(f"{ns}/join/r{rank}", json.dumps({"nonce": nonce, "node": node}))
    key = f"{ns}/welcome/r{rank}"
    while True:
        if store.poll([key], deadline) == "timeout":
            store.delete(f"{ns}/join/r{rank}")
            raise DistributedError(f"rank {rank}: rank 0 did not open the checkpoint root {tier.root!r} within "
                                   f"join_timeout_s={timeout_s:g} s (plus a grace period); {LOCAL_HINT}",
                                   missing_ranks=(0,))
        msg = store.get_json(key)
        store.delete(key)
        if msg.get("nonce") == nonce:
            break
    if "error" in msg:
        raise DistributedError(msg["error"], missing_ranks=tuple(msg.get("missing", ())))
    prefix = f"{ns}/{msg['sid']}"
    store.set(f"{prefix}/sees/r{rank}", json.dumps({"node": node, "sees": _seen(store, prefix, tier)}))
    if store.poll([f"{prefix}/ready"], time.monotonic() + timeout_s) == "timeout":
        raise DistributedError(f"rank {rank}: rank 0 did not finish the start-up round within {timeout_s:g} s",
                               missing_ranks=(0,))
    return _finish(store, prefix, rank, world, node, tier, store.get_json(f"{prefix}/ready"), timeout_s)


def _seen(store: Store, prefix: str, tier: LocalTier) -> list[int]:
    """The ranks whose probe files this rank sees in its root (one listdir)."""
    nonces = store.get_json(f"{prefix}/probes")
    try:
        names = set(os.listdir(tier.root))
    except OSError:
        names = set()
    return [r for r, n in enumerate(nonces) if PROBE_PREFIX + n in names]


def _welcome(store: Store, ns: str, world: int, sid: str, nonce: str, node: str, deadline: float,
             timeout_s: float, root: str) -> None:
    try:
        joins = store.gather(f"{ns}/join", range(1, world), deadline, lambda who: (
            f"{who} of {world} did not open the checkpoint root {root!r} within join_timeout_s={timeout_s:g} s; "
            f"{LOCAL_HINT}"))
    except DistributedError as exc:  # tell the ranks that did join, so they fail now, not at their timeout
        missing = list(exc.missing_ranks)
        for r in [r for r in range(1, world) if missing and r not in missing]:
            j = store.get_json(f"{ns}/join/r{r}")
            store.set(f"{ns}/welcome/r{r}", json.dumps({"nonce": j["nonce"], "error": str(exc), "missing": missing}))
            store.delete(f"{ns}/join/r{r}")
        raise
    store.delete(*(f"{ns}/join/r{r}" for r in range(1, world)))
    store.set(f"{ns}/{sid}/probes", json.dumps([nonce] + [j["nonce"] for j in joins]))
    for r, j in zip(range(1, world), joins):
        store.set(f"{ns}/welcome/r{r}", json.dumps({"nonce": j["nonce"], "sid": sid}))


def form_groups(sees: list[list[int]], nodes: list[str], root: str) -> list[list[int]]:
    """Ranks that see each other's probes share a copy (groups ascending by leader); raises
    :class:`ConfigError` naming the ranks for a view that is not an equivalence."""
    views = [frozenset(v) for v in sees]
    for r, v in enumerate(views):
        if r not in v:
            raise ConfigError(f"rank {r} (node {nodes[r]}) does not see its own probe file in its checkpoint root "
                              f"{root!r} (as that rank spells it): is the directory writable and not a view that "
                              "hides new files (e.g. an NFS attribute cache)? Use a directory every rank of the node "
                              "reads back, or a per-node dist_name")
        for q in v:
            if views[q] != v:
                odd = sorted(v ^ views[q])
                raise ConfigError(
                    f"ranks {r} (node {nodes[r]}) and {q} (node {nodes[q]}) disagree on which ranks share the "
                    f"checkpoint root {root!r}: rank {r} sees ranks {sorted(v)}, rank {q} sees {sorted(views[q])} "
                    f"(differing: {odd}). Each rank's root must be either one directory shared with exactly the "
                    "ranks that see it, or its node's own; check the mounts on those nodes")
    return [sorted(g) for g in sorted(set(views), key=min)]


def _decide(store: Store, prefix: str, world: int, node: str, tier: LocalTier, timeout_s: float) -> Session:
    own_view = _seen(store, prefix, tier)
    infos = [{"node": node, "sees": own_view}] + store.gather(
        f"{prefix}/sees", range(1, world), time.monotonic() + timeout_s,
        lambda who: f"{who} joined but did not finish the start-up round within {timeout_s:g} s")
    store.delete(*(f"{prefix}/sees/r{r}" for r in range(1, world)), f"{prefix}/probes")
    nodes = [i["node"] for i in infos]
    ready: dict[str, Any] = {"nodes": nodes}
    try:
        groups = form_groups([i["sees"] for i in infos], nodes, tier.root)
        ready["groups"] = groups
        if len(groups) == 1:
            tier.own()  # rank 0 is the one owner (lock, leftovers) of a shared root
    except ZerostallError as exc:  # every rank fails now, not after a commit timeout
        kind = "config" if isinstance(exc, ConfigError) else "lock"
        err = str(exc) if kind == "config" else f"rank 0 could not take the checkpoint root: {exc}"
        store.set(f"{prefix}/ready", json.dumps(dict(ready, error=err, kind=kind, groups=[list(range(world))])))
        if store.add(f"{prefix}/setup_ack", 1) == world:
            store.delete(f"{prefix}/ready", f"{prefix}/setup_ack")
        raise
    store.set(f"{prefix}/ready", json.dumps(ready))
    return _finish(store, prefix, 0, world, node, tier, ready, timeout_s)


def _finish(store: Store, prefix: str, rank: int, world: int, node: str, tier: LocalTier,
            ready: dict[str, Any], timeout_s: float) -> Session:
    groups = [tuple(g) for g in ready["groups"]]
    leaders = tuple(g[0] for g in groups)
    mine = next(g for g in groups if rank in g)
    node_local = len(groups) > 1
    try:
        if "error" in ready:
            if ready.get("kind") == "config":
                raise ConfigError(ready["error"])
            raise RootLockedError(ready["error"], root=tier.root)
        if node_local:  # each copy's leader owns it; every rank learns the outcome
            if rank == mine[0]:
                try:
                    tier.own()
                except ZerostallError as exc:
                    store.set(f"{prefix}/cleaned/r{rank}", json.dumps(
                        {"error": f"rank {rank} could not take its copy of the root on node {node}: {exc}"}))
                    raise
                store.set(f"{prefix}/cleaned/r{rank}", "{}")
            try:
                cleaned = store.gather(f"{prefix}/cleaned", leaders, time.monotonic() + timeout_s, lambda who: (
                    f"rank {rank}: the leader of a root copy ({who}) did not take it within {timeout_s:g} s"))
                if errors := [e for m in cleaned if (e := m.get("error"))]:
                    raise RootLockedError(errors[0], root=tier.root)
            except ZerostallError:
                tier.release()
                raise
    finally:
        if store.add(f"{prefix}/setup_ack", 1) == world:
            store.delete(f"{prefix}/ready", f"{prefix}/setup_ack", *(f"{prefix}/cleaned/r{r}" for r in leaders))
    return Session(prefix, rank, world, node_local, leaders, tuple(f"g{r}" for r in leaders), f"g{mine[0]}", node=node,
                   members=tuple(mine), nodes=tuple(ready["nodes"]),
                   leader_of=tuple(next(g[0] for g in groups if r in g) for r in range(world)))
