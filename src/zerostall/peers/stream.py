"""Moving one file's bytes over a peer connection: the sender's paced ``sendfile`` with read-ahead
(:func:`send_range`), the receiver's checked, double-buffered O_DIRECT write (:func:`fill_from`),
and the token bucket both sides pace with (:class:`Pacer`).

Called on the connection's thread (a server connection thread, a replicator transfer thread,
a restore fetch thread); nothing here is shared but a :class:`Pacer`.
"""

from __future__ import annotations

import mmap
import os
import socket
import threading
import time
from typing import Any, Callable

from .verify import StreamCheck
from .wire import PeerError

fault_hook: Callable[[str], None] | None = None
"""Test seam: called as ``fault_hook(point)`` at each named state of a copy to a holder (the
kill sweep of the tests SIGKILLs the process there). The sender's points: ``send:connect``
(connected, before the handshake), ``send:handshake`` (authenticated, nothing asked yet),
``send:mid-stream`` (half the file sent), ``send:sent`` (every byte sent, no answer yet); the
holder's: ``recv:handshake`` (accepted, before the handshake), ``recv:mid-stream`` (half
received), ``recv:before-fsync`` (every byte received and verified), ``recv:before-rename``
(fdatasync'ed under ``.incoming-*``), ``recv:before-ack`` (renamed, the digest not sent); a
holder serving a restore: ``serve:sending`` (the reply and manifest sent, no file byte yet)."""


def at(point: str) -> None:
    if fault_hook is not None:
        fault_hook(point)

BUF_BYTES = 4 << 20
"""The receiver's buffers (two per transfer) and the unit it checks and writes."""
FETCH_BUF_BYTES = 16 << 20
"""A restore's buffers (two per file or range fetched at once): someone waits for a restore,
and larger pieces keep the holder's ``sendfile`` and the O_DIRECT writes busier (measured:
docs/speed-tricks.md)."""
SEND_BYTES = 16 << 20
"""Bytes per ``sendfile`` call (and per pacing step) on the sender: fewer, larger calls."""
READ_AHEAD_BYTES = 32 << 20
"""How far ahead of ``sendfile`` the sender asks the kernel to read (``POSIX_FADV_WILLNEED``):
a holder's copy was written with O_DIRECT, so it is not cached, and ``sendfile``'s own
read-ahead (128 KiB-2 MiB) keeps one request in flight at a time."""


PIECES_PER_TIMEOUT = 8
"""A paced transfer moves pieces of at most ``rate * timeout_s / PIECES_PER_TIMEOUT`` bytes, so
the pause between two of a transfer's pieces stays well within the peer's ``timeout_s`` (a
quarter of it with two transfers sharing the pacer, half with four)."""
MIN_PIECE_BYTES = 64 << 10


class Pacer:
    """A token bucket shared by every transfer it paces (``rate`` bytes/s; None: no cap). Any thread.

    Send before sleep: a transfer moves a piece of at most :attr:`piece_bytes`, then pays for it
    with :meth:`take`. The first byte of a transfer never waits for the bucket, and no pause
    between two pieces is longer than the pieces queued before it take at ``rate``; the other
    end, which fails a transfer after ``timeout_s`` without progress, never times out on the
    pacer (:class:`~zerostall.config.PeersConfig` refuses a ``rate`` and ``timeout_s`` too small
    for that)."""

    def __init__(self, rate: int | None, timeout_s: float | None = None):
        self.rate = rate
        self._mu = threading.Lock()
        self._next = time.monotonic()
        self.piece_bytes = SEND_BYTES
        """The most bytes a transfer moves before it pays (:data:`PIECES_PER_TIMEOUT`)."""
        if rate and timeout_s is not None:
            self.piece_bytes = max(MIN_PIECE_BYTES, min(SEND_BYTES, int(rate * timeout_s / PIECES_PER_TIMEOUT)))

    def take(self, n: int) -> None:
        """Pay for ``n`` bytes just moved: sleep until the bucket allows the next piece."""
        if not self.rate:
            return
        with self._mu:
            now = time.monotonic()
            start = max(self._next, now - 0.05)  # at most 50 ms of burst credit
            self._next = start + n / self.rate
            wait = self._next - now
        if wait > 0:
            time.sleep(wait)


def send_range(sock: socket.socket, f: Any, offset: int, length: int, pacer: Pacer | None = None) -> int:
    """``sendfile`` bytes ``[offset, offset + length)`` of open file ``f`` to ``sock`` in
    ``SEND_BYTES`` pieces (each paced), keeping ``READ_AHEAD_BYTES`` of read-ahead requested.
    Returns the bytes sent; stops early (returning fewer) when the receiver closed: its answer
    says why."""
    fd = f.fileno()
    ahead = offset  # read-ahead requested up to here
    end = offset + length
    off = offset
    try:
        while off < end:
            if ahead < min(end, off + READ_AHEAD_BYTES // 2):
                nxt = min(end, off + READ_AHEAD_BYTES)
                try:
                    os.posix_fadvise(fd, ahead, nxt - ahead, os.POSIX_FADV_WILLNEED)
                except OSError:
                    pass
                ahead = nxt
            n = min(SEND_BYTES if pacer is None else pacer.piece_bytes, end - off)
            sent = sock.sendfile(f, off, n)
            if not sent:
                raise PeerError(f"sent {off - offset} of {length} bytes")
            off += sent
            if pacer is not None:
                pacer.take(sent)  # after the send: the holder never waits on the bucket for a first byte
    except OSError:
        pass  # the receiver gave up early
    return off - offset


def fill_from(sock: socket.socket, size: int, w: Any, check: StreamCheck, pacer: Pacer | None = None,
              start: int = 0, point: str = "", buf_bytes: int = BUF_BYTES) -> None:
    """Receive ``size`` bytes into aligned buffers, check them, write them to ``w`` at file
    offsets ``start``.. (aligned extents: shard files are multiples of 4096 bytes, ranges start
    at aligned tensor offsets). Two buffers: while chunk k's O_DIRECT write is in flight
    (``w.write``'s ``overlap``), chunk k+1 is received and checked into the other, so the socket
    keeps draining and the sender keeps reading; each chunk is checked before it is written,
    and every byte before the caller commits. A single-buffer loop (receive, check, write, in
    turn) stalls the sender during every write (measured: docs/speed-tricks.md). ``pacer``: the receiver's own cap (a holder pacing what it takes in);
    ``point``: the :data:`fault_hook` prefix (``"recv"`` for a holder's copy); ``buf_bytes``:
    each buffer's size (:data:`BUF_BYTES` for copies, :data:`FETCH_BUF_BYTES` for restores)."""
    bufs = [mmap.mmap(-1, buf_bytes), mmap.mmap(-1, buf_bytes)]
    mvs = [memoryview(b) for b in bufs]

    def recv(mv: memoryview, off: int) -> int:
        n = min(buf_bytes, size - off)
        got = 0
        while got < n:
            k = sock.recv_into(mv[got:n if pacer is None else min(n, got + pacer.piece_bytes)])
            if not k:
                raise PeerError(f"transfer cut after {off + got} of {size} bytes")
            if point and off + got < size // 2 <= off + got + k:
                at(f"{point}:mid-stream")
            got += k
            if pacer is not None:
                pacer.take(k)  # after the read, in pieces: the sender never stalls past its timeout
        check.feed(mv[:n])
        return n

    try:
        off, i = 0, 0
        n = recv(mvs[0], 0) if size else 0
        while n:
            nxt: list[int] = []

            def overlap(j: int = 1 - i, at: int = off + n) -> None:
                nxt.append(recv(mvs[j], at) if at < size else 0)
            w.write([(start + off, mvs[i][:n])], overlap=overlap)
            if not nxt:  # an engine that did not call it
                overlap()
            off, n, i = off + n, nxt[0], 1 - i
    finally:
        for mv, buf in zip(mvs, bufs):
            try:
                mv.release()
                buf.close()
            except BufferError:  # slices still referenced by an exception's frames: unmapped by the GC
                pass
