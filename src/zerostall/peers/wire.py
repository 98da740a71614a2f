"""The peer protocol's messages, its handshake and the checks every field goes through.

A message is a 4-byte big-endian length and a JSON object (at most ``MAX_HEADER_BYTES``, a
handshake's ``MAX_HANDSHAKE_BYTES``, nested at most ``MAX_DEPTH`` deep, checked before it is
parsed); binary bodies follow with the length the header declared. Both sides check every
field before acting on it (``check_*``): a hostile message is refused and the connection closed.

Handshake (mutual, per connection; the secret never crosses the wire)::

    server -> client   {"v": 1, "node": S, "nonce": ns}
    client -> server   {"node": C, "nonce": nc, "mac": HMAC(secret, "c|" ns "|" nc "|" C)}
    server -> client   {"mac": HMAC(secret, "s|" nc "|" ns "|" S)}   (or {"error": ...} and close)

The secret: :mod:`.exchange`. Everything here runs on the calling thread, on a socket whose
timeout the caller set.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import os
import re
import socket
import struct
from dataclasses import dataclass
from typing import Any

from ..errors import ZerostallError
from ..format.layout import SHARD_NAME_RE

VERSION = 1
MAX_HEADER_BYTES = 1 << 20
MAX_HANDSHAKE_BYTES = 4096  # three short fields
MAX_DEPTH = 16  # the protocol's own messages nest four deep; checked before the parser recurses
MAX_MANIFEST_BYTES = 64 << 20
MAX_STEP = (1 << 63) - 1
NODE_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._:-]{0,127}$")
_LEN = struct.Struct(">I")


class PeerError(ZerostallError):
    """A peer refused a request, broke the protocol or could not be reached."""


@dataclass(frozen=True)
class Endpoint:
    """Where a node's peer server listens (published through the c10d store)."""

    node: str
    host: str
    port: int


def send_msg(sock: socket.socket, obj: dict[str, Any]) -> None:
    data = json.dumps(obj, separators=(",", ":")).encode()
    sock.sendall(_LEN.pack(len(data)) + data)


def recv_exact(sock: socket.socket, n: int) -> bytes:
    buf = bytearray(n)
    mv = memoryview(buf)
    got = 0
    while got < n:
        k = sock.recv_into(mv[got:])
        if not k:
            raise PeerError(f"the peer closed the connection after {got} of {n} bytes")
        got += k
    return bytes(buf)


def recv_msg(sock: socket.socket, limit: int = MAX_HEADER_BYTES) -> dict[str, Any]:
    """The next message; ``limit``: its most bytes (:data:`MAX_HANDSHAKE_BYTES` in a handshake)."""
    return _recv(sock, recv_exact(sock, _LEN.size), limit)


def recv_msg_or_eof(sock: socket.socket) -> dict[str, Any] | None:
    """The next message, or None when the peer closed the connection before sending one."""
    first = sock.recv(1)
    if not first:
        return None
    return _recv(sock, first + recv_exact(sock, _LEN.size - 1))


_STRING = re.compile(rb'"(?:[^"\\]|\\.)*"')
_BRACKETS = re.compile(rb"[\[\]{}]")


def nesting(raw: bytes) -> int:
    """The deepest nesting of arrays and objects in JSON text ``raw`` (strings skipped)."""
    depth = deepest = 0
    for m in _BRACKETS.finditer(_STRING.sub(b'""', raw)):
        if m.group() in (b"[", b"{"):
            depth += 1
            deepest = max(deepest, depth)
        else:
            depth -= 1
    return deepest


def _recv(sock: socket.socket, raw: bytes, limit: int = MAX_HEADER_BYTES) -> dict[str, Any]:
    (n,) = _LEN.unpack(raw)
    if n > limit:
        raise PeerError(f"message of {n} bytes refused (limit {limit})")
    body = recv_exact(sock, n)
    if nesting(body) > MAX_DEPTH:
        raise PeerError(f"message nested deeper than {MAX_DEPTH} levels refused")
    try:
        obj = json.loads(body)
    except (ValueError, UnicodeDecodeError, RecursionError) as exc:
        raise PeerError(f"malformed message: {str(exc)[:200]}") from None
    if not isinstance(obj, dict):
        raise PeerError("malformed message: not a JSON object")
    return obj


def recv_ok(sock: socket.socket, what: str) -> dict[str, Any]:
    """The reply to a request, ``{"ok": true, ...}``; else :class:`PeerError` ``"<what>: <error>"``."""
    reply = recv_msg(sock)
    if not reply.get("ok"):
        raise PeerError(f"{what}: {reply.get('error')}")
    return reply


def _mac(secret: bytes, *parts: str) -> str:
    return hmac.new(secret, "|".join(parts).encode(), hashlib.sha256).hexdigest()


def server_handshake(sock: socket.socket, secret: bytes, me: str) -> str:
    """Authenticate the client; returns its node name. Raises :class:`PeerError` (the caller
    logs it and closes the connection)."""
    ns = os.urandom(16).hex()
    send_msg(sock, {"v": VERSION, "node": me, "nonce": ns})
    try:
        msg = recv_msg(sock, MAX_HANDSHAKE_BYTES)
    except PeerError as exc:
        raise PeerError(f"handshake refused: {exc}") from None
    node, nc, mac = msg.get("node"), msg.get("nonce"), msg.get("mac")
    if not (isinstance(node, str) and NODE_RE.match(node) and isinstance(nc, str) and len(nc) == 32
            and isinstance(mac, str)):
        send_msg(sock, {"error": "malformed handshake"})
        raise PeerError("malformed handshake")
    if not hmac.compare_digest(mac, _mac(secret, "c", ns, nc, node)):
        send_msg(sock, {"error": "authentication failed"})
        raise PeerError(f"authentication failed (claimed node {node!r}): not a process of this job")
    send_msg(sock, {"mac": _mac(secret, "s", nc, ns, me)})
    return node


def client_handshake(sock: socket.socket, secret: bytes, me: str) -> str:
    """Authenticate to the server and the server to us; returns the server's node name."""
    hello = recv_msg(sock, MAX_HANDSHAKE_BYTES)
    node, ns = hello.get("node"), hello.get("nonce")
    if hello.get("v") != VERSION or not isinstance(node, str) or not NODE_RE.match(node) \
            or not isinstance(ns, str) or len(ns) != 32:
        raise PeerError(f"unexpected greeting from the peer: {str(hello)[:200]}")
    nc = os.urandom(16).hex()
    send_msg(sock, {"node": me, "nonce": nc, "mac": _mac(secret, "c", ns, nc, me)})
    reply = recv_msg(sock, MAX_HANDSHAKE_BYTES)
    if "error" in reply:
        raise PeerError(f"peer {node} refused us: {reply['error']}")
    if not hmac.compare_digest(str(reply.get("mac", "")), _mac(secret, "s", nc, ns, node)):
        raise PeerError(f"peer at {sock.getpeername()} claiming node {node!r} does not know the job's secret")
    return node


# -- field checks: each returns the value or raises PeerError naming it ------------------

def check_node(v: Any) -> str:
    if not isinstance(v, str) or not NODE_RE.match(v):
        raise PeerError(f"bad node name {str(v)[:80]!r}")
    return v


def check_step(v: Any) -> int:
    if not isinstance(v, int) or isinstance(v, bool) or not 0 <= v <= MAX_STEP:
        raise PeerError(f"bad step {str(v)[:40]!r}")
    return v


def check_sender(msg: dict[str, Any], peer: str, nodes: set[str], me: str) -> tuple[str, int]:
    """A put's ``src`` and ``step``: ``src`` must be the authenticated ``peer``, another node of the job."""
    src, step = check_node(msg.get("src")), check_step(msg.get("step"))
    if src not in nodes or src == me or src != peer:
        raise PeerError(f"node {peer!r} may copy only its own files here, not node {src!r}'s")
    return src, step


def check_name(v: Any) -> str:
    if not isinstance(v, str) or not SHARD_NAME_RE.match(v):
        raise PeerError(f"bad file name {str(v)[:80]!r} (expected rank-NNNNN.shard)")
    return v


def check_size(v: Any, limit: int, what: str) -> int:
    if not isinstance(v, int) or isinstance(v, bool) or not 0 <= v <= limit:
        raise PeerError(f"bad {what} size {str(v)[:40]!r} (limit {limit})")
    return v
