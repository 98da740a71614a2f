"""Plain TCP peer transport: the committed file read ahead with O_DIRECT and sent, the receiver
checks every byte and writes it with O_DIRECT (:mod:`.stream`; messages and handshake: :mod:`.wire`).

Requests after the handshake, each answered ``{"ok": true, ...}`` or ``{"ok": false,
"error": ...}`` (then the connection is closed)::

    {"op": "put", "src", "step", "name", "size", "manifest_bytes"} + manifest + file bytes
        -> {"ok": true, "digest"}   after verify, fdatasync, rename, fsync of the directory
    {"op": "list"}                 -> {"ok": true, "held": [...]}
    {"op": "get", "src", "step", "name"}
        -> {"ok": true, "size", "manifest_bytes"} + manifest + file bytes

``serve(store)`` once at start-up (node leaders, ``Checkpointer.__init__``'s thread); ``put``,
``list_held``, ``get`` from the replicator's and the restore's threads, each on a connection of
its own; ``close()`` never blocks longer than a socket shutdown. Every socket has ``timeout_s``.
The server runs one daemon thread per connection (at most ``max_connections``; when all are
taken, the oldest not yet authenticated is dropped, so strangers cannot lock the peers out).
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import socket
import threading
from typing import Any, Callable

from ..errors import ConfigError, ZerostallError
from ..format.manifest import Manifest
from .store import PeerStore
from .stream import FETCH_BUF_BYTES, Pacer, at, background, fill_from, roomy_send_buffer, send_range, shutdown
from .verify import StreamCheck, file_entry, split_points
from .wire import (MAX_MANIFEST_BYTES, Endpoint, PeerError, check_name, check_node, check_sender, check_size,
                   check_step, client_handshake, recv_exact, recv_msg, recv_msg_or_eof, recv_ok, send_msg,
                   server_handshake)

__all__ = ["Pacer", "TcpTransport", "fill_from"]
log = logging.getLogger("zerostall")
MAX_FILE_BYTES = 1 << 46

Sink = Callable[[Manifest, int], tuple[Any, StreamCheck]]
"""``get``'s destination: ``(manifest, size) -> (open engine writer, StreamCheck to feed)``."""


def _serving_io_priority() -> None:
    """A connection thread serving a restore or a listing: best-effort disk I/O (someone waits)."""
    try:
        import psutil
        psutil.Process(threading.get_native_id()).ionice(psutil.IOPRIO_CLASS_BE, 4)
    except Exception as exc:  # noqa: BLE001 - best effort: non-Linux, seccomp
        log.debug("zerostall: cannot set the I/O priority of a peer connection: %s", exc)


def _addr(s: socket.socket) -> Any:
    try:
        return s.getpeername()
    except OSError:
        return "?"


def _bind_error(me: str, host: str, port: int, exc: OSError) -> str:
    """Why node ``me`` cannot listen on ``host:port``, and what to change."""
    where = f"{'peers.listen_port=%d: ' % port if port else ''}node {me} cannot listen on {host}:{port} " \
            f"({exc.strerror or exc})"
    if exc.errno == errno.EADDRINUSE:
        return (f"{where}; another process holds that port (or another node of this job on the same address): "
                "free it, pick another one (ZEROSTALL_PEER_PORT), or 0 for a port the kernel picks")
    if exc.errno == errno.EACCES:
        return (f"{where}; ports below 1024 need privileges (CAP_NET_BIND_SERVICE): pick one above 1023 "
                "(ZEROSTALL_PEER_PORT), or 0 for a port the kernel picks")
    if exc.errno == errno.EADDRNOTAVAIL:
        return (f"{where}; {host} is not an address of this host: set peers.listen_host to one of its "
                "addresses, or None for the one that reaches MASTER_ADDR")
    return f"{where}; check peers.listen_host and peers.listen_port"


class TcpTransport:
    def __init__(self, secret: bytes, me: str, nodes: set[str], *, timeout_s: float, pacer: Pacer,
                 listen_host: str = "127.0.0.1", max_connections: int = 32, recv_pacer: Pacer | None = None,
                 cpu_priority: str = "normal", listen_port: int = 0):
        self.cpu_priority = cpu_priority  # a connection thread receiving a copy lowers itself to this
        self.secret, self.me, self.nodes = secret, me, set(nodes)
        self.timeout_s, self.pacer = timeout_s, pacer
        self.recv_pacer = recv_pacer  # the holder's cap on the copies it takes in, all senders together
        self.listen_host, self.listen_port, self.max_connections = listen_host, listen_port, max_connections
        self._srv: socket.socket | None = None
        self._conns: set[socket.socket] = set()  # every open connection, ours and accepted (close() ends them)
        self._served: set[socket.socket] = set()  # accepted: what max_connections bounds (not our own)
        self._unauth: list[socket.socket] = []  # accepted, handshake not done yet: oldest first
        self._mu = threading.Lock()
        self._closed = False
        self.refused = 0  # connections refused (failed handshake, bad request): tests, doctor
        self.ops: dict[str, Any] = {}  # more requests: op -> handler(conn, peer, msg) (:func:`.fragments.register`)

    # -- server ------------------------------------------------------------------------
    def serve(self, store: PeerStore) -> tuple[str, int]:
        """Start serving ``store`` (puts, lists, gets); returns the ``(host, port)`` listened on."""
        self.store = store
        store.clean()
        try:
            self._srv = socket.create_server((self.listen_host, self.listen_port), backlog=64)
        except OSError as exc:  # a ConfigError: the start-up exchange hands it to every rank at once
            raise ConfigError(_bind_error(self.me, self.listen_host, self.listen_port, exc)) from exc
        threading.Thread(target=self._accept, name="zerostall-peers-accept", daemon=True).start()
        return self._srv.getsockname()[:2]

    def _accept(self) -> None:
        srv = self._srv
        while srv is not None and not self._closed:
            try:
                conn, addr = srv.accept()
            except OSError:
                return
            evict = None
            with self._mu:
                full = len(self._served) >= self.max_connections
                if full and self._unauth:  # a stranger (or a slow peer) yields its slot
                    evict = self._unauth.pop(0)
                    self._conns.discard(evict)
                    self._served.discard(evict)
                    full = False
                if not full:
                    self._conns.add(conn)
                    self._served.add(conn)
                    self._unauth.append(conn)
            if evict is not None:
                log.warning("zerostall: peer connection %s dropped before it authenticated: every slot was taken",
                            _addr(evict))
                shutdown(evict, socket.SHUT_RDWR)  # its thread's recv fails; it closes the socket
            if full:
                log.warning("zerostall: peer connection from %s refused: %d connections open", addr,
                            self.max_connections)
                conn.close()
                continue
            threading.Thread(target=self._serve_conn, args=(conn, addr), name="zerostall-peers-conn",
                             daemon=True).start()

    def _serve_conn(self, conn: socket.socket, addr: Any) -> None:
        conn.settimeout(self.timeout_s)
        roomy_send_buffer(conn)  # a holder serving a restore keeps its link busy while it waits for a core
        peer = "?"
        try:
            try:
                at("recv:handshake")
                peer = server_handshake(conn, self.secret, self.me)
                with self._mu:
                    if conn in self._unauth:
                        self._unauth.remove(conn)
            except (PeerError, OSError) as exc:
                log.warning("zerostall: peer connection from %s refused: %s", addr, exc)
                self.refused += 1  # after the log: a test that saw the count finds the line
                return
            while not self._closed:
                msg = recv_msg_or_eof(conn)
                if msg is None:
                    return  # the client is done
                self._handle(conn, peer, msg)
        except (PeerError, ZerostallError, OSError, ValueError, KeyError, TypeError) as exc:
            log.warning("zerostall: request from node %s (%s) refused: %s", peer, addr, exc)
            self.refused += 1
            with contextlib.suppress(OSError):
                send_msg(conn, {"ok": False, "error": str(exc)[:2000]})
        except Exception as exc:  # noqa: BLE001 - a connection thread never dies unlogged
            log.error("zerostall: connection from node %s (%s) failed: %s: %s", peer, addr, type(exc).__name__,
                      str(exc)[:500])
            self.refused += 1
        finally:
            with self._mu:
                self._conns.discard(conn)
                self._served.discard(conn)
                if conn in self._unauth:
                    self._unauth.remove(conn)
            conn.close()

    def _handle(self, conn: socket.socket, peer: str, msg: dict[str, Any]) -> None:
        op = msg.get("op")
        if op == "put":  # receiving copies yields the CPU and the disk (for good: this thread only receives)
            background(self.cpu_priority)
        else:  # serving a restore does not
            _serving_io_priority()
        if op == "list":
            send_msg(conn, {"ok": True, "held": self.store.held()})
        elif op == "put":
            src, step = check_sender(msg, peer, self.nodes, self.me)
            name = check_name(msg.get("name"))
            size = check_size(msg.get("size"), MAX_FILE_BYTES, "file")
            man_bytes = recv_exact(conn, check_size(msg.get("manifest_bytes"), MAX_MANIFEST_BYTES, "manifest"))
            digest = self.store.receive(src, step, name, man_bytes, size,
                                        lambda w, check: fill_from(conn, size, w, check, self.recv_pacer, point="recv"))
            at("recv:before-ack")
            send_msg(conn, {"ok": True, "digest": digest})
            log.debug("zerostall: holding %s of step %d from %s for node %s", name, step, peer, src)
        elif op in self.ops:
            self.ops[op](conn, peer, msg)
        elif op == "get":
            src, step, name = check_node(msg.get("src")), check_step(msg.get("step")), check_name(msg.get("name"))
            found = self.store.path_for(src, step, name)
            if found is None:
                send_msg(conn, {"ok": False, "error": f"{name} of step {step} of {src} is not held here"})
                return
            path, man = found
            man_bytes = man.to_bytes()
            with open(path, "rb", buffering=0) as f:
                size = os.fstat(f.fileno()).st_size
                start = check_size(msg.get("offset", 0), size, "range offset")
                length = check_size(msg.get("length", size - start), size - start, "range length")
                if start and start not in split_points(man, name):
                    raise PeerError(f"{name}: a range may start only where a tensor starts, not at byte {start}")
                send_msg(conn, {"ok": True, "size": size, "manifest_bytes": len(man_bytes), "offset": start,
                                "length": length})
                conn.sendall(man_bytes)
                at("serve:sending")
                send_range(conn, f, start, length)
        else:
            raise PeerError(f"unknown request {str(op)[:40]!r}")

    # -- client ------------------------------------------------------------------------
    def open(self, ep: Endpoint, op: str = "") -> socket.socket:
        """An authenticated connection to ``ep`` (``op``: the fault-hook prefix); :meth:`release` it."""
        try:
            s = socket.create_connection((ep.host, ep.port), timeout=self.timeout_s)
        except OSError as exc:
            raise PeerError(f"node {ep.node} ({ep.host}:{ep.port}) cannot be reached: {exc}") from exc
        if op:
            at(f"{op}:connect")
        s.settimeout(self.timeout_s)
        with self._mu:
            if self._closed:
                s.close()
                raise PeerError("the peer transport is closed")
            self._conns.add(s)
        try:
            node = client_handshake(s, self.secret, self.me)
        except OSError as exc:  # TimeoutError: a stopped or overloaded peer
            self.release(s)
            raise PeerError(f"node {ep.node} ({ep.host}:{ep.port}): no handshake within {self.timeout_s:g} s "
                            f"({exc or 'timed out'})") from exc
        except BaseException:
            self.release(s)
            raise
        if node != ep.node:
            self.release(s)
            raise PeerError(f"{ep.host}:{ep.port} is node {node!r}, not {ep.node!r}")
        if op:
            at(f"{op}:handshake")
        return s

    def release(self, s: socket.socket) -> None:
        with self._mu:
            self._conns.discard(s)
        s.close()

    def call(self, ep: Endpoint, what: str, fn: Any, op: str = "") -> Any:
        """``fn(socket)`` on a fresh connection to ``ep``; errors name the node and ``what``."""
        s = self.open(ep, op)
        try:
            return fn(s)
        except (OSError, PeerError) as exc:
            if isinstance(exc, PeerError) and str(exc).startswith(f"node {ep.node}"):
                raise
            raise PeerError(f"node {ep.node}: {what} failed: {exc}") from exc
        finally:
            self.release(s)

    def put(self, ep: Endpoint, src: str, step: int, name: str, path: str, man_bytes: bytes) -> str:
        """Copy committed file ``path`` (``name`` of ``src``'s ``step``) to ``ep``; returns the
        receiver's digest once it has verified, fsynced and committed the file."""
        def run(s: socket.socket) -> str:
            with open(path, "rb", buffering=0) as f:
                size = os.fstat(f.fileno()).st_size
                send_msg(s, {"op": "put", "src": src, "step": step, "name": name, "size": size,
                             "manifest_bytes": len(man_bytes)})
                s.sendall(man_bytes)
                half = send_range(s, f, 0, size // 2, self.pacer)
                if half == size // 2:
                    at("send:mid-stream")
                    if send_range(s, f, half, size - half, self.pacer) == size - half:
                        at("send:sent")
                with contextlib.suppress(OSError):  # without O_DIRECT the read-ahead went through the cache
                    os.posix_fadvise(f.fileno(), 0, 0, os.POSIX_FADV_DONTNEED)
            return str(recv_ok(s, f"node {ep.node} refused {name} of step {step}").get("digest"))
        return self.call(ep, f"copying {name} of step {step}", run, "send")

    def list_held(self, ep: Endpoint, op: str = "list", **fields: Any) -> list[dict[str, Any]]:
        """What ``ep`` holds (:meth:`.store.PeerStore.held`; ``op="flist"``: :meth:`.fragments.FragmentStore.held`)."""
        def run(s: socket.socket) -> list[dict[str, Any]]:
            send_msg(s, {"op": op, **fields})
            reply = recv_msg(s)
            if not reply.get("ok") or not isinstance(reply.get("held"), list):
                raise PeerError(f"node {ep.node} did not list what it holds ({op}): {reply.get('error')}")
            return reply["held"]
        return self.call(ep, "listing", run)

    def get(self, ep: Endpoint, src: str, step: int, name: str, sink: Sink, rng: tuple[int, int] | None = None) -> str:
        """Stream ``name`` of ``src``'s ``step`` from ``ep`` into ``sink``'s writer, checked;
        returns the digest of what was received. ``rng``: only bytes ``[start, end)``, written
        at their offsets (``start`` 0 or a :func:`~.verify.split_points` offset)."""
        def run(s: socket.socket) -> str:
            req: dict[str, Any] = {"op": "get", "src": src, "step": step, "name": name}
            if rng is not None:
                req.update(offset=rng[0], length=rng[1] - rng[0])
            send_msg(s, req)
            reply = recv_ok(s, f"node {ep.node}")
            size = check_size(reply.get("size"), MAX_FILE_BYTES, "file")
            man = Manifest.from_bytes(recv_exact(s, check_size(reply.get("manifest_bytes"), MAX_MANIFEST_BYTES,
                                                               "manifest")))
            start, end = rng if rng is not None else (0, size)
            if man.step != step or file_entry(man, name).file_bytes != size or \
                    (reply.get("offset", 0), reply.get("length", size)) != (start, end - start):
                raise PeerError(f"node {ep.node} sent {name} of step {man.step} with {size} bytes (range "
                                f"{reply.get('offset')}+{reply.get('length')}), which its manifest or our request "
                                "does not describe")
            w, check = sink(man, size)
            fill_from(s, end - start, w, check, start=start, buf_bytes=FETCH_BUF_BYTES)
            return check.digest()
        what = f"fetching {name} of step {step}" + (f" (bytes {rng[0]}..{rng[1]})" if rng else "")
        return self.call(ep, what, run)

    def close(self) -> None:
        """Stop serving and abort open transfers (idempotent)."""
        self._closed = True
        srv, self._srv = self._srv, None
        if srv is not None:
            shutdown(srv, socket.SHUT_RDWR)  # wakes the accept() of the accept thread
            srv.close()
        with self._mu:
            conns = list(self._conns)
        for c in conns:
            shutdown(c, socket.SHUT_RDWR)
