"""Coded copies on the wire and on a holder's disk: one fragment of one node's step per holder.

On the holder, in :mod:`.store`'s step directory (retention, quota and cleaning as for files)::

    peers/<src>/step-<N>/manifest.json    the step's manifest, durable before any fragment
    peers/<src>/step-<N>/coding.json      the coding descriptor (:meth:`.coding.Layout.describe`)
    peers/<src>/step-<N>/fragment-<i>     a 4096-byte header block + the fragment's bytes
    peers/<src>/step-<N>/.incoming-*      a transfer in flight (removed at start-up)

The header block is ``MAGIC`` + JSON ``{index, bytes, crc32c, descriptor}``, zero padded. A
fragment is held once its final name exists (:meth:`.store.PeerStore.keep`), its crc32c equal to
the one the sender announces after the last byte; then acknowledged with the crc32c.

Requests (registered on :class:`.tcp.TcpTransport`; fault points ``frag-send:*``,
``frag-recv:*``, ``frag-serve:mid-stream``)::

    {"op": "fput", "src", "step", "index", "size", "manifest_bytes", "coding_bytes"}
        + manifest + descriptor + fragment bytes, then {"crc32c"}  -> {"ok", "digest"}
    {"op": "flist", "src"}                     -> {"ok", "held": [{step, checkpoint_id, ...}]}
    {"op": "fget", "src", "step", "index"}     -> {"ok", "manifest_bytes", "coding_bytes",
                                                  "size"} + manifest + descriptor + file

Threads: the server's connection threads, a restore's fetch threads (:func:`download`).
"""

from __future__ import annotations

import json
import logging
import mmap
import os
import re
import socket
from typing import Any, Callable

import crc32c as _crc

from ..config import ALIGN_BYTES
from ..errors import CorruptCheckpoint
from ..format.manifest import Manifest
from .coding import Layout, descriptor_id
from .status import held_dirs
from .store import PeerStore
from .stream import FETCH_BUF_BYTES, Pacer, at, background, fill_from, send_range
from .wire import (MAX_MANIFEST_BYTES, Endpoint, PeerError, check_node, check_sender, check_size, check_step,
                   recv_exact, recv_msg, recv_ok, send_msg)

__all__ = ["CODING_NAME", "FragmentStore", "download", "register"]
log = logging.getLogger("zerostall")
CODING_NAME = "coding.json"
MAGIC = b"ZSFRAG1\n"
HEADER = ALIGN_BYTES
MAX_FRAGMENT_BYTES = 1 << 44
_FRAG_RE = re.compile(r"^fragment-(\d{1,2})$")


def fragment_name(index: int) -> str:
    return f"fragment-{index}"


def header_block(index: int, nbytes: int, crc: int, desc_id: str) -> bytes:
    body = MAGIC + json.dumps({"index": index, "bytes": nbytes, "crc32c": crc, "descriptor": desc_id}).encode()
    return body.ljust(HEADER, b"\0")


def parse_header(raw: bytes, where: str) -> dict[str, Any]:
    if len(raw) != HEADER or not raw.startswith(MAGIC):
        raise CorruptCheckpoint(f"{where}: not a fragment (bad header block)", path=where)
    try:
        doc = json.loads(raw[len(MAGIC):].rstrip(b"\0"))
        if not all(isinstance(doc.get(k), t) for k, t in (("index", int), ("bytes", int), ("crc32c", int),
                                                           ("descriptor", str))):
            raise ValueError("missing fields")
    except (ValueError, UnicodeDecodeError, AttributeError) as exc:
        raise CorruptCheckpoint(f"{where}: bad fragment header ({exc})", path=where) from None
    return doc


class FragmentCheck:
    """crc32c of a fragment's bytes as they stream in (:func:`.stream.fill_from`'s check)."""

    def __init__(self) -> None:
        self.crc, self.n = 0, 0

    def feed(self, mv: memoryview) -> None:
        self.crc = _crc.crc32c(mv, self.crc)
        self.n += len(mv)

    def digest(self) -> str:
        return f"{self.crc:08x}"


class FragmentStore:
    """The fragments a holder keeps, in :class:`.store.PeerStore`'s step directories."""

    def __init__(self, store: PeerStore):
        self.store = store

    def receive(self, src: str, step: int, index: int, man_bytes: bytes, desc_bytes: bytes, size: int,
                fill: Callable[[Any, FragmentCheck], int]) -> str:
        """Keep fragment ``index`` (``size`` bytes announced): ``fill(writer, check)`` streams its
        bytes in at offset ``HEADER`` and returns the crc32c the sender announced."""
        man = Manifest.from_bytes(man_bytes)
        where = f"{src}:step-{step}/{fragment_name(index)}"
        lay, doc = Layout.parse(desc_bytes, where)
        if size != lay.fragment_bytes:
            raise PeerError(f"{where}: {size} bytes announced, the descriptor says {lay.fragment_bytes}")
        if man.step != step or doc["step"] != step or doc["checkpoint_id"] != man.checkpoint_id or \
                doc["src"] != src or not 0 <= index < lay.k + lay.m:
            raise PeerError(f"{where}: the descriptor, the manifest and the request disagree")
        ps = self.store
        ps.open_step(src, step, man, lambda held: held.checkpoint_id == man.checkpoint_id and  # else overwritten
                     self._desc(src, step) == desc_bytes, ((CODING_NAME, desc_bytes),))  # or re-coded
        check = FragmentCheck()

        def write(w: Any) -> None:
            claimed = fill(w, check)
            if check.n != lay.fragment_bytes or check.crc != claimed:
                raise CorruptCheckpoint(f"{where}: received {check.n} bytes with crc32c {check.crc:08x}; "
                                        f"the sender sent {lay.fragment_bytes} with {claimed:08x}", path=where)
            head = mmap.mmap(-1, HEADER)  # O_DIRECT: an aligned buffer
            head[:] = header_block(index, lay.fragment_bytes, check.crc, descriptor_id(desc_bytes))
            w.write([(0, memoryview(head))])
        ps.keep(src, step, fragment_name(index), HEADER + lay.fragment_bytes, write,
                lambda: self._desc(src, step) == desc_bytes, "frag-recv")
        return check.digest()

    def _desc(self, src: str, step: int) -> bytes | None:
        try:
            with open(os.path.join(self.store.step_dir(src, step), CODING_NAME), "rb") as f:
                return f.read(MAX_MANIFEST_BYTES)
        except OSError:
            return None

    def _coding(self, src: str, step: int) -> tuple[bytes, Manifest, Layout, dict[str, Any]] | None:
        """``(descriptor bytes, manifest, layout, descriptor)`` of a coded step held here, or None."""
        raw, man = self._desc(src, step), self.store.manifest(src, step)
        if raw is None or man is None:
            return None
        try:
            return (raw, man, *Layout.parse(raw, self.store.step_dir(src, step)))
        except CorruptCheckpoint:
            return None

    def held(self, src: str | None = None) -> list[dict[str, Any]]:
        """``[{src, step, checkpoint_id, created_unix, descriptor, k, m, fragments: {index: crc32c}}]``
        of every step (of ``src``, if given) of which complete fragments are held here."""
        out = []
        for s, step, d in held_dirs(self.store.tier.root):
            got = self._coding(s, step) if src is None or s == src else None
            if got is None:
                continue
            raw, man, lay, doc = got
            frags: dict[str, int] = {}
            for name in os.listdir(d):
                try:
                    h = read_header(os.path.join(d, name), lay.fragment_bytes) if _FRAG_RE.match(name) else None
                except (OSError, CorruptCheckpoint):
                    continue
                if h is not None and name == fragment_name(h["index"]) and h["descriptor"] == descriptor_id(raw):
                    frags[str(h["index"])] = h["crc32c"]
            if frags and doc["checkpoint_id"] == man.checkpoint_id:
                out.append({"src": s, "step": step, "checkpoint_id": man.checkpoint_id,
                            "created_unix": man.created_unix, "descriptor": descriptor_id(raw), "k": lay.k,
                            "m": lay.m, "fragments": frags})
        return out

    def path_for(self, src: str, step: int, index: int) -> tuple[str, bytes, bytes] | None:
        """``(fragment path, manifest bytes, descriptor bytes)`` of a held fragment; None otherwise."""
        got = self._coding(src, step)
        path = os.path.join(self.store.step_dir(src, step), fragment_name(index))
        try:
            if got is None:
                return None
            read_header(path, got[2].fragment_bytes)
        except (OSError, CorruptCheckpoint):
            return None
        return path, got[1].to_bytes(), got[0]


def read_header(path: str, fragment_bytes: int) -> dict[str, Any]:
    with open(path, "rb") as f:
        h = parse_header(f.read(HEADER), path)
        if os.fstat(f.fileno()).st_size != HEADER + fragment_bytes or h["bytes"] != fragment_bytes:
            raise CorruptCheckpoint(f"{path}: {os.fstat(f.fileno()).st_size} bytes, expected "
                                    f"{HEADER + fragment_bytes}", path=path)
    return h


# -- server side: registered on the transport ------------------------------------------------

def register(transport: Any, frags: FragmentStore, nodes: set[str], me: str, cpu_priority: str,
             recv_pacer: Pacer | None) -> None:
    """Serve ``fput``, ``flist`` and ``fget`` on ``transport`` (before it serves)."""

    def fput(conn: socket.socket, peer: str, msg: dict[str, Any]) -> None:
        background(cpu_priority)  # receiving copies yields the CPU and the disk
        src, step = check_sender(msg, peer, nodes, me)
        index = check_size(msg.get("index"), 63, "fragment index")
        size = check_size(msg.get("size"), MAX_FRAGMENT_BYTES, "fragment")
        man_bytes = recv_exact(conn, check_size(msg.get("manifest_bytes"), MAX_MANIFEST_BYTES, "manifest"))
        desc = recv_exact(conn, check_size(msg.get("coding_bytes"), 1 << 20, "coding descriptor"))

        def fill(w: Any, check: FragmentCheck) -> int:
            fill_from(conn, size, w, check, recv_pacer, start=HEADER, point="frag-recv")
            tail = recv_msg(conn)
            return check_size(tail.get("crc32c"), 0xFFFFFFFF, "crc32c")
        digest = frags.receive(src, step, index, man_bytes, desc, size, fill)
        at("frag-recv:before-ack")
        send_msg(conn, {"ok": True, "digest": digest})

    def flist(conn: socket.socket, peer: str, msg: dict[str, Any]) -> None:
        src = msg.get("src")
        send_msg(conn, {"ok": True, "held": frags.held(check_node(src) if src is not None else None)})

    def fget(conn: socket.socket, peer: str, msg: dict[str, Any]) -> None:
        src, step = check_node(msg.get("src")), check_step(msg.get("step"))
        index = check_size(msg.get("index"), 63, "fragment index")
        found = frags.path_for(src, step, index)
        if found is None:
            send_msg(conn, {"ok": False, "error": f"fragment {index} of step {step} of {src} is not held here"})
            return
        path, man_bytes, desc = found
        with open(path, "rb", buffering=0) as f:
            size = os.fstat(f.fileno()).st_size
            send_msg(conn, {"ok": True, "size": size, "manifest_bytes": len(man_bytes), "coding_bytes": len(desc)})
            conn.sendall(man_bytes + desc)
            if send_range(conn, f, 0, size // 2) == size // 2:
                at("frag-serve:mid-stream")
                send_range(conn, f, size // 2, size - size // 2)

    transport.ops.update(fput=fput, flist=flist, fget=fget)


# -- client side -----------------------------------------------------------------------------

def download(transport: Any, ep: Endpoint, src: str, step: int, index: int,
             sink: Callable[[bytes, bytes, dict[str, Any]], tuple[Any, FragmentCheck]],
             connected: Callable[[], None] | None = None,
             first_byte: Callable[[], None] | None = None) -> tuple[bytes, bytes]:
    """Fetch fragment ``index`` of ``src``'s ``step`` from ``ep`` into ``sink(manifest bytes,
    descriptor, header)``'s writer (at offsets 0..) through its check; raises unless their crc32c
    is the header's. ``connected``, ``first_byte``: a restore's timeline. Returns (manifest, descriptor)."""
    def run(s: socket.socket) -> tuple[bytes, bytes]:
        if connected is not None:
            connected()
        send_msg(s, {"op": "fget", "src": src, "step": step, "index": index})
        reply = recv_ok(s, f"node {ep.node}")
        if first_byte is not None:
            first_byte()
        size = check_size(reply.get("size"), MAX_FRAGMENT_BYTES + HEADER, "fragment")
        man_bytes = recv_exact(s, check_size(reply.get("manifest_bytes"), MAX_MANIFEST_BYTES, "manifest"))
        desc = recv_exact(s, check_size(reply.get("coding_bytes"), 1 << 20, "coding descriptor"))
        where = f"{ep.node}:{src}/step-{step}/{fragment_name(index)}"
        head = parse_header(recv_exact(s, HEADER), where)
        if head["index"] != index or head["descriptor"] != descriptor_id(desc) or size != HEADER + head["bytes"]:
            raise PeerError(f"{where}: the holder sent a fragment its header or descriptor does not describe")
        w, check = sink(man_bytes, desc, head)
        fill_from(s, head["bytes"], w, check, buf_bytes=min(FETCH_BUF_BYTES, max(HEADER, head["bytes"])))
        if check.crc != head["crc32c"]:
            raise CorruptCheckpoint(f"{where}: crc32c {check.crc:08x} of the bytes received, "
                                    f"{head['crc32c']:08x} recorded", path=where)
        return man_bytes, desc
    return transport.call(ep, f"fetching fragment {index} of step {step}", run)
