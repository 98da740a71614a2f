"""Joining the ranks of one checkpoint root: the c10d store behind error translation and
polling, and the start-up round that every collective ``Checkpointer`` runs.

Who calls what: ``Checkpointer.__init__`` (caller's thread) calls :func:`join` once; the
commit rounds (:mod:`.commit`) then use the returned :class:`Session` from the persist
thread, and the caller's thread only for non-blocking failure reports.

Never a blocking ``store.wait``: a c10d store client serialises its requests, so a wait of
minutes on the persist thread would hold up every other user of the same client — the
training's own ``new_group``/NCCL initialisation included. Waits here poll ``check`` with a
short backoff instead; every request holds the client for one round trip.

Keys live under a namespace derived from the checkpoint root (a hash of its absolute path,
or of ``dist_name`` when the ranks' paths differ, e.g. per-host node-local roots), never from
a per-process counter. The start-up round:

1. every rank ``r > 0`` sets ``<ns>/join/r<r>`` = ``{nonce, host}``;
2. rank 0 creates a token file in the root, waits for every join key (``join_timeout_s``),
   deletes them and answers each rank with ``<ns>/welcome/r<r>`` = ``{nonce, sid, token}``
   (or ``{nonce, error}``: a rank is missing, everybody fails at once). A welcome whose nonce
   is not the reader's own is a stale answer to an earlier, abandoned join and is skipped;
3. under the session prefix ``<ns>/<sid>`` every rank reports whether it sees the token file
   (a shared root) and its host; rank 0 decides ``node_local`` and the leader (lowest rank)
   of each host; on a shared root rank 0 owns it (``LocalTier.own``: the root lock, held for
   the Checkpointer's life, and start-up recovery), then publishes ``ready``;
4. on a node-local root each host's leader owns its own copy of the root and sets
   ``cleaned/<host>`` (with the error, if it could not); every rank waits for all hosts';
   a root that could not be taken fails every rank now (:class:`RootLockedError`), not
   after a commit timeout;
5. every rank adds 1 to ``setup_ack``; the one that completes the count deletes the keys.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import time
import uuid
from dataclasses import dataclass
from typing import Any, Callable

from ..errors import DistributedError, RootLockedError, ZerostallError
from ..store.local import LocalTier
from .node import node_id

log = logging.getLogger("zerostall")

LOCAL_HINT = ("every rank must create the same Checkpointer (same path or dist_name); a process that "
              "saves alone (rank-0-only saving, tools) needs dist_mode='local'")


def namespace(root: str, name: str | None = None) -> str:
    """The store namespace of a checkpoint root: agreed by every rank without a counter."""
    src = name if name is not None else os.path.abspath(root)
    return "zerostall/" + hashlib.sha256(src.encode()).hexdigest()[:16]


class Store:
    """A c10d store whose errors arrive as :class:`DistributedError` (cause chained) and
    whose waits poll. Safe from any thread (the client serialises requests)."""

    def __init__(self, store: Any):
        self.raw = store

    def _call(self, what: str, fn: Callable[[], Any]) -> Any:
        try:
            return fn()
        except DistributedError:
            raise
        except Exception as exc:  # noqa: BLE001 - DistStoreError/DistNetworkError/RuntimeError by version
            raise DistributedError(f"the c10d store failed on {what}: {exc} (is rank 0, which hosts the "
                                   "store, still alive?)") from exc

    def set(self, key: str, value: str) -> None:
        self._call(f"set {key!r}", lambda: self.raw.set(key, value))

    def get(self, key: str) -> bytes:
        return self._call(f"get {key!r}", lambda: self.raw.get(key))

    def get_json(self, key: str) -> Any:
        return json.loads(self.get(key))

    def multi_get_json(self, keys: list[str]) -> list[Any]:
        if hasattr(self.raw, "multi_get"):
            vals = self._call(f"multi_get of {len(keys)} keys", lambda: self.raw.multi_get(keys))
        else:
            vals = [self.get(k) for k in keys]
        return [json.loads(v) for v in vals]

    def add(self, key: str, n: int) -> int:
        return int(self._call(f"add {key!r}", lambda: self.raw.add(key, n)))

    def check(self, keys: list[str]) -> bool:
        return bool(self._call(f"check of {len(keys)} keys", lambda: self.raw.check(keys)))

    def delete(self, *keys: str) -> None:
        """Best effort: a key that is gone, or a store that is gone, is not an error here."""
        for k in keys:
            try:
                self.raw.delete_key(k)
            except Exception as exc:  # noqa: BLE001
                log.debug("zerostall: could not delete store key %s: %s", k, exc)

    def poll(self, keys: list[str], deadline: float, abort: str | None = None) -> str:
        """Wait until every key exists (``"ok"``), ``abort`` exists (``"abort"``) or the
        monotonic ``deadline`` passes (``"timeout"``)."""
        delay = 0.002
        while True:
            if self.check(keys):
                return "ok"
            if abort is not None and self.check([abort]):
                return "abort"
            left = deadline - time.monotonic()
            if left <= 0:
                return "timeout"
            time.sleep(min(delay, left))
            delay = min(delay * 1.5, 0.1)

    def missing(self, keys: list[str]) -> list[str]:
        return [k for k in keys if not self.check([k])]


def _rank_of(key: str) -> int:
    return int(key.rsplit("/r", 1)[1])


@dataclass(frozen=True)
class Session:
    """What the ranks agreed at start-up; ``prefix`` scopes every later key."""

    prefix: str
    rank: int
    world: int
    node_local: bool
    leaders: tuple[int, ...]
    hosts: tuple[str, ...]
    host: str


def join(store: Store, ns: str, rank: int, world: int, tier: LocalTier, timeout_s: float) -> Session:
    """The start-up round (module docstring). Raises :class:`DistributedError` naming the
    ranks that did not join within ``timeout_s``."""
    host = node_id()  # ZEROSTALL_NODE: simulated nodes on one machine are distinct hosts
    deadline = time.monotonic() + timeout_s
    if rank == 0:
        sid = uuid.uuid4().hex[:16]
        token = f".zerostall-shared-{sid}"
        token_path = os.path.join(tier.root, token)
        with open(token_path, "w"):
            pass
        try:
            _welcome(store, ns, world, sid, token, deadline, timeout_s, tier.root)
            return _decide(store, f"{ns}/{sid}", world, host, tier, timeout_s)
        finally:
            try:
                os.unlink(token_path)
            except OSError:
                pass
    # Rank 0 decides who is missing at its own deadline and answers the ranks present; the
    # others give it a grace period beyond theirs, so both never give up at the same moment
    # (a rank withdrawing its join key while rank 0 reads it would be reported missing).
    deadline += min(max(2.0, timeout_s / 2), 30.0)
    nonce = uuid.uuid4().hex
    store.set(f"{ns}/join/r{rank}", json.dumps({"nonce": nonce, "host": host}))
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
    sees = os.path.exists(os.path.join(tier.root, msg["token"]))
    store.set(f"{prefix}/sees/r{rank}", json.dumps({"host": host, "sees": sees}))
    if store.poll([f"{prefix}/ready"], time.monotonic() + timeout_s) == "timeout":
        raise DistributedError(f"rank {rank}: rank 0 did not finish the start-up round within {timeout_s:g} s",
                               missing_ranks=(0,))
    return _finish(store, prefix, rank, world, host, tier, store.get_json(f"{prefix}/ready"), timeout_s)


def _welcome(store: Store, ns: str, world: int, sid: str, token: str, deadline: float, timeout_s: float,
             root: str) -> None:
    keys = [f"{ns}/join/r{r}" for r in range(1, world)]
    if store.poll(keys, deadline) == "timeout":
        missing = [_rank_of(k) for k in store.missing(keys)]
        msg = (f"rank(s) {', '.join(map(str, missing))} of {world} did not open the checkpoint root {root!r} "
               f"within join_timeout_s={timeout_s:g} s; {LOCAL_HINT}")
        for k in keys:  # tell the ranks that did join, so they fail now rather than at their timeout
            if _rank_of(k) not in missing:
                j = store.get_json(k)
                store.set(f"{ns}/welcome/r{_rank_of(k)}",
                          json.dumps({"nonce": j["nonce"], "error": msg, "missing": missing}))
                store.delete(k)
        raise DistributedError(msg, missing_ranks=tuple(missing))
    joins = store.multi_get_json(keys)
    store.delete(*keys)
    for r, j in zip(range(1, world), joins):
        store.set(f"{ns}/welcome/r{r}", json.dumps({"nonce": j["nonce"], "sid": sid, "token": token}))


def _decide(store: Store, prefix: str, world: int, host: str, tier: LocalTier, timeout_s: float) -> Session:
    keys = [f"{prefix}/sees/r{r}" for r in range(1, world)]
    if store.poll(keys, time.monotonic() + timeout_s) == "timeout":
        missing = [_rank_of(k) for k in store.missing(keys)]
        raise DistributedError(f"rank(s) {', '.join(map(str, missing))} joined but did not finish the start-up "
                               f"round within {timeout_s:g} s", missing_ranks=tuple(missing))
    infos = [{"host": host, "sees": True}] + store.multi_get_json(keys)
    store.delete(*keys)
    node_local = not all(i["sees"] for i in infos)
    leaders: dict[str, int] = {}
    for r, i in enumerate(infos):
        leaders.setdefault(i["host"], r)
    ready: dict[str, Any] = {"node_local": node_local, "leaders": sorted(leaders.values()), "hosts": sorted(leaders)}
    if not node_local:
        try:
            tier.own()  # rank 0 is the one owner (lock, leftovers) of a shared root
        except ZerostallError as exc:  # every rank fails now, not after a commit timeout
            store.set(f"{prefix}/ready", json.dumps(dict(ready, error=f"rank 0 could not take the checkpoint "
                                                                     f"root: {exc}")))
            if store.add(f"{prefix}/setup_ack", 1) == world:
                store.delete(f"{prefix}/ready", f"{prefix}/setup_ack")
            raise
    store.set(f"{prefix}/ready", json.dumps(ready))
    return _finish(store, prefix, 0, world, host, tier, ready, timeout_s)


def _finish(store: Store, prefix: str, rank: int, world: int, host: str, tier: LocalTier,
            ready: dict[str, Any], timeout_s: float) -> Session:
    node_local, leaders = bool(ready["node_local"]), tuple(ready["leaders"])
    try:
        if "error" in ready:
            raise RootLockedError(ready["error"], root=tier.root)
        if node_local:  # each host's leader owns its copy of the root; every rank learns the outcome
            if rank in leaders:
                err = None
                try:
                    tier.own()
                except ZerostallError as exc:
                    err = exc
                store.set(f"{prefix}/cleaned/{host}", json.dumps(
                    {"error": f"rank {rank} could not take its node-local root on {host}: {err}"} if err else {}))
                if err is not None:
                    raise err
            keys = [f"{prefix}/cleaned/{h}" for h in ready["hosts"]]
            if store.poll(keys, time.monotonic() + timeout_s) == "timeout":
                tier.release()
                raise DistributedError(f"rank {rank}: a host's leader did not take its node-local root within "
                                       f"{timeout_s:g} s")
            errors = [e for m in store.multi_get_json(keys) if (e := m.get("error"))]
            if errors:
                tier.release()
                raise RootLockedError(errors[0], root=tier.root)
    finally:
        if store.add(f"{prefix}/setup_ack", 1) == world:
            store.delete(f"{prefix}/ready", f"{prefix}/setup_ack", *(f"{prefix}/cleaned/{h}" for h in ready["hosts"]))
    return Session(prefix, rank, world, node_local, leaders, tuple(ready["hosts"]), host)
