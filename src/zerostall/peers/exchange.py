"""What the ranks tell each other about peer replicas, through the c10d store (never a collective
on the training's group), the placement of copies, and the secret the handshake uses.

Keys live under the session prefix agreed at start-up (:mod:`zerostall.distributed.session`)::

    <p>/peers/node/r<R>        {node, domain, fp} every rank, at start-up (fp: a fingerprint of
                                                  the secret it was given, never the secret)
    <p>/peers/secret           hex(32 random bytes), drawn by rank 0 only when the launcher gave
                               no secret (:func:`given_secret`)
    <p>/peers/ep/<node>        {host, port, deleted} each node's leader once serving (deleted:
                                                  its tombstones)
    <p>/peers/s<step>/<node>   {holders, error}   each node's leader, once its copies of the step
                                                  are held or failed (:mod:`.replicate`)
    <p>/peers/s<step>/seen     counter: the rank completing it deletes the step's keys
    <p>/peers/load<k>/node/<n>/s<N>  {ok, error}  node n's leader, after fetching step N (:mod:`.fetch`)

:func:`setup` runs on the caller's thread of ``Checkpointer.__init__``.
"""

from __future__ import annotations

import hashlib
import hmac
import ipaddress
import json
import logging
import os
import secrets
import socket
import stat
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Sequence

from ..distributed.node import failure_domain, node_id
from ..distributed.store import Store
from ..errors import ConfigError, DistributedError, ZerostallError
from . import tombstones
from .wire import Endpoint

log = logging.getLogger("zerostall")

SECRET_ENV = "ZEROSTALL_PEER_SECRET"
SECRET_FILE_ENV = "ZEROSTALL_PEER_SECRET_FILE"
_warned = False


# -- placement ------------------------------------------------------------------------
# Rendezvous (HRW) hashing over node names: every other node h scores sha256(src | h); first the
# best of each failure domain not used yet (never src's own), then the best-scored rest. A node
# joining or leaving moves only the placements that involved it; the step does not enter the hash.

@dataclass(frozen=True, order=True)
class Node:
    """One node of the job: its name (``ZEROSTALL_NODE``) and failure domain."""

    name: str
    domain: str


def _score(src: str, cand: str) -> bytes:
    return hashlib.sha256(f"zerostall-peers|{src}|{cand}".encode()).digest()


def ranking(src: str, nodes: Sequence[Node]) -> list[Node]:
    """Every node but ``src``, best holder first (domain spread, then HRW score)."""
    by_name = {n.name: n for n in nodes}  # src is one of them (the view's own node)
    home = by_name[src].domain
    others = sorted((n for n in by_name.values() if n.name != src), key=lambda n: _score(src, n.name), reverse=True)
    first, rest, used = [], [], {home}
    for n in others:
        if n.domain not in used:
            used.add(n.domain)
            first.append(n)
        else:
            rest.append(n)
    return first + rest


def holders(src: str, nodes: Sequence[Node], replicas: int) -> tuple[str, ...]:
    """The ``replicas - 1`` nodes that keep copies of ``src``'s files (the placement above)."""
    if replicas - 1 > len({n.name for n in nodes}) - 1:
        raise ConfigError(f"replicas={replicas} needs at least {replicas} nodes; the job has "
                          f"{len({n.name for n in nodes})} (set ZEROSTALL_NODE per node, or lower replicas)")
    return tuple(n.name for n in ranking(src, nodes)[:replicas - 1])


def given_secret() -> bytes | None:
    """The job's peer secret as the launcher gave it (``ZEROSTALL_PEER_SECRET_FILE``: a regular
    file of this user, mode 0600 or 0400; else ``ZEROSTALL_PEER_SECRET``; at least 16 characters),
    or None (the store fallback). Raises :class:`ConfigError` naming the variable or file."""
    path = os.environ.get(SECRET_FILE_ENV)
    if path:
        try:
            fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
        except OSError as exc:
            raise ConfigError(f"{SECRET_FILE_ENV}={path!r}: cannot open it ({exc.strerror}); give a regular file "
                              "readable only by the job's user (chmod 600)") from None
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode) or st.st_uid != os.geteuid() or st.st_mode & 0o077:
                raise ConfigError(f"{SECRET_FILE_ENV}={path!r} is not a regular file of this user readable by it "
                                  f"alone (mode {stat.S_IMODE(st.st_mode):o}, owner uid {st.st_uid}): run "
                                  f"`chmod 600 {path}` as its owner")
            raw = os.read(fd, 1 << 16).strip()
        finally:
            os.close(fd)
        what = SECRET_FILE_ENV
    elif os.environ.get(SECRET_ENV):
        raw, what = os.environ[SECRET_ENV].strip().encode(), SECRET_ENV
    else:
        return None
    if len(raw) < 16:
        raise ConfigError(f"{what}: the peer secret must be at least 16 characters (e.g. `openssl rand -hex 32`)")
    return raw


def session_key(given: bytes, prefix: str) -> bytes:
    """The handshake key of this session, derived from the given secret (never stored)."""
    return hmac.new(given, b"zerostall-peers|" + prefix.encode(), hashlib.sha256).digest()


def fingerprint(key: bytes) -> str:
    """What a rank publishes of its key (ranks given different secrets fail at once): a MAC of
    a fixed label, useless for the handshake."""
    return hmac.new(key, b"zerostall-peers-fingerprint", hashlib.sha256).hexdigest()[:32]


@dataclass(frozen=True)
class PeerView:
    """The job as this rank sees it once :func:`setup` returned."""

    prefix: str
    rank: int
    world: int
    me: str
    nodes: tuple[Node, ...]
    rank_nodes: tuple[str, ...]
    endpoints: dict[str, Endpoint] = field(compare=False)
    secret: bytes = field(repr=False, compare=False)
    deleted: dict[int, dict[str, Any]] = field(default_factory=dict, compare=False)
    """Every node's tombstones merged (:mod:`.tombstones`): steps deleted for good."""

    @property
    def leader(self) -> bool:
        """Whether this rank serves and sends for its node (the lowest rank on it)."""
        return self.rank_nodes.index(self.me) == self.rank

    def ranks_of(self, node: str) -> list[int]:
        return [r for r, n in enumerate(self.rank_nodes) if n == node]

    def key(self, *parts: object) -> str:
        return "/".join([self.prefix, "peers", *map(str, parts)])


def in_parallel(fn: Callable[..., None], args: Iterable[tuple[Any, ...]], name: str = "zerostall-peers") -> None:
    """``fn(*a)`` for every ``a`` of ``args``, each on a daemon thread of its own; returns once all returned."""
    threads = [threading.Thread(target=fn, args=a, name=name, daemon=True) for a in args]
    for t in threads:
        t.start()
    for t in threads:
        t.join()


def ask_peers(view: PeerView, ask: Callable[[Endpoint], Any], what: str) -> dict[str, Any]:
    """node -> ``ask(its endpoint)`` for every other node, in parallel; a node that fails is left out."""
    out: dict[str, Any] = {}

    def one(node: str) -> None:
        try:
            out[node] = ask(view.endpoints[node])
        except (ZerostallError, OSError) as exc:
            log.warning("zerostall: %s: node %s did not answer (%s); what it holds is not counted", what, node, exc)
    in_parallel(one, [(n,) for n in view.endpoints if n != view.me])
    return out


def advertised_host(listen_host: str | None) -> tuple[str, str]:
    """``(listen on, publish)``: an explicit host as is; else loopback when ``MASTER_ADDR`` is
    local, else every interface, published as the address that reaches ``MASTER_ADDR``."""
    if listen_host:
        return listen_host, listen_host
    master = os.environ.get("MASTER_ADDR", "127.0.0.1")
    try:
        local = ipaddress.ip_address(socket.gethostbyname(master)).is_loopback
    except (OSError, ValueError):
        local = False
    if local:
        return "127.0.0.1", "127.0.0.1"
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.connect((master, 9))  # no packet is sent: this only picks the route
            return "0.0.0.0", s.getsockname()[0]
    except OSError:
        return "0.0.0.0", socket.gethostbyname(socket.gethostname())


def _poll(store: Store, keys: list[str], timeout_s: float, what: str) -> None:
    if store.poll(keys, time.monotonic() + timeout_s) == "timeout":
        missing = store.missing(keys)
        raise DistributedError(f"peer replicas: {what} did not arrive within {timeout_s:g} s "
                               f"(missing {', '.join(missing[:8])}); is every rank running with the same replicas=?")


def duplicate_names(names: list[str], copies: tuple[int, ...]) -> str:
    """The refusal of a job in which one node name labels ranks that write separate copies of
    the root (``copies``: every rank's, as its leader's rank), or "" if none does."""
    seen: dict[str, dict[int, int]] = {}
    for r, (n, c) in enumerate(zip(names, copies)):
        seen.setdefault(n, {}).setdefault(c, r)
    bad = {n: sorted(cs.values()) for n, cs in seen.items() if len(cs) > 1}
    if not bad:
        return ""
    what = "; ".join(f"ranks {', '.join(map(str, rs))} all call their node {n!r} but write separate roots"
                     for n, rs in sorted(bad.items()))
    return (f"peer replicas: {what}. Give every machine its own ZEROSTALL_NODE (ranks sharing one root on one "
            "machine keep one name): with a name shared by two machines, copies would be placed on the very "
            "machine they protect, and no step could be protected")


def setup(store: Store, prefix: str, rank: int, world: int, replicas: int, timeout_s: float,
          serve: Callable[[bytes, str, list[Node]], tuple[str, int]], copies: tuple[int, ...] = (),
          deleted: dict[int, dict[str, Any]] | None = None) -> PeerView:
    """The start-up exchange (module doc). ``serve(secret, me, nodes)`` starts this node's
    server (node leaders only) and returns the published ``(host, port)``. ``copies``: see
    :func:`duplicate_names`. ``deleted``: this node's tombstones; the view carries every node's."""
    global _warned
    me, domain = node_id(), failure_domain()
    p = f"{prefix}/peers"
    given = given_secret()
    key = session_key(given, prefix) if given is not None else None
    store.set(f"{p}/node/r{rank}", json.dumps({"node": me, "domain": domain,
                                               "fp": fingerprint(key) if key is not None else None}))
    if rank == 0 and key is None:
        store.set(f"{p}/secret", secrets.token_hex(32))
    keys = [f"{p}/node/r{r}" for r in range(world)]
    _poll(store, keys, timeout_s, "the other ranks' node names")
    infos = store.multi_get_json(keys)
    if copies and (dup := duplicate_names([i["node"] for i in infos], copies)):
        raise ConfigError(dup)
    fps = [i.get("fp") for i in infos]
    if len(set(fps)) > 1:
        mine = fps[rank]
        odd = [r for r, f in enumerate(fps) if f != mine]
        raise ConfigError(f"peer replicas: rank(s) {', '.join(map(str, odd))} were given another peer secret than "
                          f"rank {rank} ({SECRET_ENV} / {SECRET_FILE_ENV} set alike on every rank, or on none)")
    if key is not None:
        secret = key
    else:
        _poll(store, [f"{p}/secret"], timeout_s, "the job's peer secret")
        secret = bytes.fromhex(store.get(f"{p}/secret").decode())
        if not _warned:
            _warned = True
            log.warning("zerostall: peer replicas authenticate with a secret kept in the c10d store: any process "
                        "that reaches MASTER_PORT can read it and act as a peer (read and plant checkpoint copies); "
                        "give every rank %s (or %s, a file of mode 600) to keep it out of the store "
                        "(docs/peers.md, Security)", SECRET_ENV, SECRET_FILE_ENV)
    domains: dict[str, str] = {}
    for r, i in enumerate(infos):
        if domains.setdefault(i["node"], i["domain"]) != i["domain"]:
            raise ConfigError(f"node {i['node']!r} reports two failure domains ({domains[i['node']]!r} and "
                              f"{i['domain']!r} from rank {r}); set ZEROSTALL_FAILURE_DOMAIN alike on every rank "
                              "of a node")
    nodes = tuple(sorted(Node(n, d) for n, d in domains.items()))
    if len(nodes) < replicas:
        raise ConfigError(f"replicas={replicas} needs at least {replicas} nodes; this job has {len(nodes)} "
                          f"({', '.join(n.name for n in nodes)}): set ZEROSTALL_NODE per node or lower replicas")
    rank_nodes = tuple(i["node"] for i in infos)
    view = PeerView(prefix, rank, world, me, nodes, rank_nodes, {}, secret)
    if view.leader:
        try:
            host, port = serve(secret, me, list(nodes))
        except ZerostallError as exc:  # e.g. a taken peers.listen_port: every rank fails with it, not at a timeout
            store.set(f"{p}/ep/{me}", json.dumps({"error": str(exc)}))
            raise
        store.set(f"{p}/ep/{me}", json.dumps({"host": host, "port": port,
                                              "deleted": {str(k): v for k, v in (deleted or {}).items()}}))
    ep_keys = [f"{p}/ep/{n.name}" for n in nodes]
    _poll(store, ep_keys, timeout_s, "the nodes' peer endpoints")
    got = store.multi_get_json(ep_keys)
    for n, e in zip(nodes, got):
        if "error" in e:
            raise ConfigError(f"peer replicas: node {n.name}'s peer server did not start: {e['error']}")
    eps = {n.name: Endpoint(n.name, e["host"], int(e["port"])) for n, e in zip(nodes, got)}
    merged: dict[int, dict[str, Any]] = {}
    for e in got:
        merged = tombstones.merge(merged, tombstones.parse(e.get("deleted")))
    return PeerView(prefix, rank, world, me, nodes, rank_nodes, eps, secret, merged)
