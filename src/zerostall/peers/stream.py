"""Moving one file's bytes over a peer connection: :func:`send_range` (paced, from O_DIRECT
read-ahead), :func:`fill_from` (checked, double-buffered O_DIRECT write), the :class:`Pacer` and
:func:`background`. Called on the connection's thread; nothing here is shared but a :class:`Pacer`.
"""

from __future__ import annotations

import contextlib
import errno
import functools
import logging
import mmap
import os
import queue
import socket
import threading
import time
from typing import Any, Callable, Iterator

from ..config import ALIGN_BYTES
from ..io._sys import set_idle_io_priority
from .verify import StreamCheck
from .wire import PeerError

log = logging.getLogger("zerostall")

fault_hook: Callable[[str], None] | None = None
"""Test seam: called as ``fault_hook(point)`` at each named state of a copy (the tests' kill
sweep SIGKILLs the process there): ``send:connect``, ``send:handshake``, ``send:mid-stream``,
``send:sent``; ``recv:handshake``, ``recv:mid-stream``, ``recv:before-fsync``,
``recv:before-rename``, ``recv:before-ack``; ``serve:sending``; coded copies' ``frag-*``
(:mod:`.fragments`)."""


def at(point: str) -> None:
    if fault_hook is not None:
        fault_hook(point)


def background(cpu: str) -> None:
    """Idle I/O class and ``cpu`` priority (``"idle"``: SCHED_IDLE, ``"nice"``: 19, ``"normal"``)
    for the calling thread, best effort. Only for threads that do nothing but copy replicas: an
    unprivileged thread cannot undo it, and the threads it starts inherit it."""
    set_idle_io_priority()
    tid = threading.get_native_id()
    try:
        if cpu == "idle":
            os.sched_setscheduler(tid, os.SCHED_IDLE, os.sched_param(0))
        elif cpu == "nice":
            os.setpriority(os.PRIO_PROCESS, tid, 19)
    except (AttributeError, OSError) as exc:
        log.debug("zerostall: cannot lower the CPU priority (%s) of replication thread %d: %s", cpu, tid, exc)


BUF_BYTES = 4 << 20  # a copy's receive buffers (RECV_BUFS per transfer): the unit checked and written
FETCH_BUF_BYTES = 16 << 20  # a restore's: fewer, larger O_DIRECT writes (someone waits for it)
RECV_BUFS = 3  # one being checked and written, two for the socket to fill
SEND_BYTES = 16 << 20  # the most a paced transfer moves before it pays the Pacer
SEND_BUF_BYTES = 4 << 20  # the sender's read-ahead buffers and O_DIRECT read size
SEND_BUFS = 4  # the disk reads up to three ahead of the buffer being sent
SOCKET_SEND_BYTES = 4 << 20  # the kernel send buffer a holder's connection asks for (the kernel doubles it)


@functools.lru_cache(maxsize=None)
def _sysctl(name: str, field: int) -> int:
    try:
        with open(f"/proc/sys/{name}") as f:
            return int(f.read().split()[field])
    except (OSError, ValueError, IndexError):
        return 0


def roomy_send_buffer(sock: socket.socket) -> None:
    """Give ``sock`` a send buffer of :data:`SOCKET_SEND_BYTES` (or the autotuning ceiling, if
    higher) where ``net.core.wmem_max`` allows: autotuning's few milliseconds leave the link idle
    while the sender waits for a core (docs/peers.md, "What bounds a coded restore")."""
    want = max(SOCKET_SEND_BYTES, _sysctl("net/ipv4/tcp_wmem", 2) // 2)
    if want <= _sysctl("net/core/wmem_max", 0):
        with contextlib.suppress(OSError):  # not a TCP socket (tests' socketpairs), or a seccomp filter
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, want)


PIECES_PER_TIMEOUT = 8  # paced pieces of rate * timeout_s / 8: a pause stays well within the peer's timeout_s
MIN_PIECE_BYTES = 64 << 10


class Pacer:
    """A token bucket shared by every transfer it paces (``rate`` bytes/s; None: no cap). Any thread.
    Send before sleep: a transfer moves at most :attr:`piece_bytes`, then pays with :meth:`take`,
    so the other end (which gives up after ``timeout_s`` without progress) never waits on it."""

    def __init__(self, rate: int | None, timeout_s: float | None = None):
        self.rate = rate
        self._mu = threading.Lock()
        self._next = time.monotonic()
        self.piece_bytes = SEND_BYTES
        if rate and timeout_s is not None:
            self.piece_bytes = max(MIN_PIECE_BYTES, min(SEND_BYTES, int(rate * timeout_s / PIECES_PER_TIMEOUT)))

    def take(self, n: int) -> None:
        if not self.rate:
            return
        with self._mu:
            now = time.monotonic()
            start = max(self._next, now - 0.05)  # at most 50 ms of burst credit
            self._next = start + n / self.rate
            wait = self._next - now
        if wait > 0:
            time.sleep(wait)


def _read_ahead(fd: int, offset: int, length: int) -> Iterator[memoryview]:
    """Bytes ``[offset, offset + length)`` of open file ``fd`` in order, read ahead on a thread of
    their own into :data:`SEND_BUFS` buffers, with O_DIRECT where the filesystem takes it (through
    ``/proc/self/fd``: the same inode). A read error is raised in the caller's thread; closing the
    generator stops the reader. A piece is valid until the next one is asked for."""
    end = offset + length
    try:
        dfd: int | None = os.open(f"/proc/self/fd/{fd}", os.O_RDONLY | os.O_DIRECT | os.O_CLOEXEC)
    except OSError:  # tmpfs, some FUSE: no O_DIRECT
        dfd = None
    bufs = [mmap.mmap(-1, SEND_BUF_BYTES) for _ in range(SEND_BUFS)]
    free: queue.SimpleQueue[int | None] = queue.SimpleQueue()
    full: queue.SimpleQueue[tuple[int, int, int] | BaseException | None] = queue.SimpleQueue()
    for i in range(SEND_BUFS):
        free.put(i)
    stopped = False

    def pread(mv: memoryview, pos: int) -> int:
        nonlocal dfd
        if dfd is not None and pos % ALIGN_BYTES == 0:
            try:
                return os.preadv(dfd, [mv], pos)
            except OSError as exc:
                if exc.errno != errno.EINVAL:
                    raise
                os.close(dfd)  # a filesystem that opens O_DIRECT but refuses its reads
                dfd = None
        got = 0
        while got < len(mv):
            k = os.preadv(fd, [mv[got:]], pos + got)
            if not k:
                break
            got += k
        return got

    def run() -> None:
        pos = offset - offset % ALIGN_BYTES
        try:
            while pos < end:
                i = free.get()
                if i is None or stopped:
                    return
                want = min(SEND_BUF_BYTES, -(-(end - pos) // ALIGN_BYTES) * ALIGN_BYTES)
                got = pread(memoryview(bufs[i])[:want], pos)
                if got <= 0 or (got < want and pos + got < end and dfd is None):
                    raise PeerError(f"the file ended at byte {pos + max(got, 0)}, before byte {end}")
                full.put((i, max(offset - pos, 0), min(got, end - pos)))
                pos += got
            full.put(None)
        except BaseException as exc:  # noqa: BLE001 - handed to the sending thread
            full.put(exc)

    reader = threading.Thread(target=run, name="zerostall-peers-readahead", daemon=True)
    reader.start()
    try:
        while (item := full.get()) is not None:
            if isinstance(item, BaseException):
                raise item
            i, a, b = item
            yield memoryview(bufs[i])[a:b]
            free.put(i)
    finally:
        stopped = True
        free.put(None)
        reader.join()
        if dfd is not None:
            os.close(dfd)
        unmap(bufs)


def send_range(sock: socket.socket, f: Any, offset: int, length: int, pacer: Pacer | None = None) -> int:
    """Send bytes ``[offset, offset + length)`` of open file ``f`` to ``sock`` from an O_DIRECT
    read-ahead (not ``sendfile``: docs/cluster.md, the link probe), paced by ``pacer``. Returns
    the bytes sent: fewer when the receiver closed or the file could not be read (logged), and
    then the socket is shut for writing. Raises ``TimeoutError`` when the receiver took nothing
    for the socket's timeout (a stopped peer: the caller must not wait for its answer)."""
    pieces = _read_ahead(f.fileno(), offset, length)
    sent = 0
    try:
        for mv in pieces:
            pos = 0
            while pos < len(mv):
                k = sock.send(mv[pos:pos + (len(mv) if pacer is None else pacer.piece_bytes)])
                pos += k
                sent += k
                if pacer is not None:
                    pacer.take(k)  # after the send: the holder never waits on the bucket for a first byte
            del mv
    except PeerError as exc:
        log.warning("zerostall: sending %s stopped: %s", getattr(f, "name", "a file"), exc)
    except TimeoutError:
        shutdown(sock, socket.SHUT_WR)
        raise
    except OSError as exc:
        if not isinstance(exc, ConnectionError) and exc.errno not in (errno.EPIPE, errno.ECONNRESET):
            log.warning("zerostall: reading %s to send it failed: %s", getattr(f, "name", "a file"), exc)
    finally:
        pieces.close()
    if sent < length:
        shutdown(sock, socket.SHUT_WR)
    return sent


def shutdown(sock: socket.socket, how: int) -> None:
    """``sock.shutdown(how)`` unless the other side reset or closed it already."""
    with contextlib.suppress(OSError):
        sock.shutdown(how)


def unmap(bufs: list[Any]) -> None:
    """Close mmap buffers; one still referenced is left to the GC."""
    for buf in bufs:
        with contextlib.suppress(BufferError):
            buf.close()


def fill_from(sock: socket.socket, size: int, w: Any, check: StreamCheck, pacer: Pacer | None = None,
              start: int = 0, point: str = "", buf_bytes: int = BUF_BYTES) -> None:
    """Receive ``size`` bytes, check them (``check.feed``) and write them to ``w`` at file offsets
    ``start``.. (aligned). A thread of its own receives into :data:`RECV_BUFS` buffers while the
    caller's thread checks each one, then writes it (checking the next meanwhile: the write's
    ``overlap``). ``pacer``: the receiver's own cap; ``point``: the :data:`fault_hook` prefix. On
    an error the receiving thread is woken by ``shutdown(SHUT_RD)`` (the caller may still answer)."""
    bufs = [mmap.mmap(-1, buf_bytes) for _ in range(RECV_BUFS)]
    free: queue.SimpleQueue[int | None] = queue.SimpleQueue()
    full: queue.SimpleQueue[tuple[int, int] | BaseException] = queue.SimpleQueue()
    for i in range(RECV_BUFS):
        free.put(i)

    def receive() -> None:
        off = 0
        try:
            while off < size:
                i = free.get()
                if i is None:
                    return
                mv = memoryview(bufs[i])
                try:
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
                finally:
                    mv.release()
                full.put((i, n))
                off += n
        except BaseException as exc:  # noqa: BLE001 - handed to the caller's thread
            full.put(exc)

    t = threading.Thread(target=receive, name="zerostall-peers-recv", daemon=True)
    t.start()
    taken = [0]  # bytes handed over by the receiving thread so far

    def take(block: bool) -> tuple[int, int, int] | None:
        """The next filled buffer, checked: (index, bytes, file offset - start), or None."""
        if taken[0] >= size:
            return None
        try:
            item = full.get(block)
        except queue.Empty:
            return None
        if isinstance(item, BaseException):
            raise item
        i, n = item
        piece = (i, n, taken[0])
        taken[0] += n
        mv = memoryview(bufs[i])
        try:
            check.feed(mv[:n])
        finally:
            mv.release()
        return piece

    try:
        ready = take(True)
        while ready is not None:
            nxt: list[tuple[int, int, int] | None] = [None]

            def overlap() -> None:  # the next piece, if in, is checked while this one is written
                nxt[0] = take(False)
            i, n, off = ready
            mv = memoryview(bufs[i])
            try:
                w.write([(start + off, mv[:n])], overlap)
            finally:
                mv.release()
            free.put(i)
            ready = nxt[0] if nxt[0] is not None else take(True)
    except BaseException:
        free.put(None)
        shutdown(sock, socket.SHUT_RD)  # a receive in progress returns
        raise
    finally:
        t.join(10)
        unmap(bufs)
