"""The byte movers under the peer transport (:mod:`zerostall.peers.stream`), over a real local
socket pair and real files: the sender's O_DIRECT read-ahead (:func:`send_range`) at aligned
and unaligned offsets, on a filesystem with O_DIRECT and one without, and the receiver's
threaded receive (:func:`fill_from`), which checks every piece before writing it and stops
its receiving thread when the check fails."""

from __future__ import annotations

import os
import socket
import threading

import pytest

from zerostall.errors import CorruptCheckpoint
from zerostall.peers import stream
from zerostall.peers.stream import fill_from, send_range
from zerostall.peers.wire import PeerError


def _file(d, size: int) -> tuple[str, bytes]:
    data = os.urandom(size)
    path = os.path.join(str(d), "f.shard")
    with open(path, "wb") as f:
        f.write(data)
    return path, data


def _receive_all(sock: socket.socket, out: bytearray) -> None:
    while (b := sock.recv(1 << 20)):
        out += b


def _send(path: str, offset: int, length: int) -> tuple[int, bytes]:
    a, b = socket.socketpair()
    got = bytearray()
    t = threading.Thread(target=_receive_all, args=(b, got))
    t.start()
    with open(path, "rb", buffering=0) as f:
        sent = send_range(a, f, offset, length)
    a.shutdown(socket.SHUT_WR)
    t.join(30)
    a.close()
    b.close()
    return sent, bytes(got)


@pytest.mark.parametrize("offset,length", [(0, None), (4096 * 3, 4096 * 700), (4096 * 2048 + 2048, None),
                                           (1000, 5000), (12288, 0)])
def test_send_range_sends_exactly_the_range_read_ahead_with_o_direct(tmp_path, monkeypatch, offset, length):
    monkeypatch.setattr(stream, "SEND_BUF_BYTES", 1 << 20)  # many buffers' worth: the ring turns over
    size = (9 << 20) + 4096 * 5
    path, data = _file(tmp_path, size)
    length = size - offset if length is None else length
    sent, got = _send(path, offset, length)
    assert sent == length
    assert got == data[offset:offset + length]


def test_send_range_without_o_direct_reads_buffered(tmp_path, monkeypatch):
    """A filesystem that refuses O_DIRECT (tmpfs, some FUSE): the same bytes, read buffered."""
    real_open = os.open

    def no_direct(p, flags, *a):
        if flags & os.O_DIRECT:
            raise OSError(22, "Invalid argument")
        return real_open(p, flags, *a)
    monkeypatch.setattr(stream.os, "open", no_direct)
    monkeypatch.setattr(stream, "SEND_BUF_BYTES", 1 << 20)
    path, data = _file(tmp_path, (3 << 20) + 123)  # not a multiple of 4096: a buffered read's tail
    sent, got = _send(path, 2048, len(data) - 2048)
    assert (sent, got) == (len(data) - 2048, data[2048:])


def test_send_range_stops_short_when_the_file_is_shorter_than_the_range(tmp_path):
    path, data = _file(tmp_path, 1 << 20)
    sent, got = _send(path, 0, 2 << 20)
    assert sent == 1 << 20 and got == data  # the receiver sees a cut transfer, never made-up bytes


class _Check:
    def __init__(self, fail_at: int | None = None):
        self.fed, self.fail_at = bytearray(), fail_at

    def feed(self, mv: memoryview) -> None:
        if self.fail_at is not None and len(self.fed) + len(mv) > self.fail_at:
            raise CorruptCheckpoint("bad piece")
        self.fed += mv


class _Writer:
    def __init__(self):
        self.extents: list[tuple[int, bytes]] = []

    def write(self, extents, overlap=None):
        self.extents += [(off, bytes(mv)) for off, mv in extents]


def test_fill_from_checks_then_writes_every_piece_in_order(monkeypatch):
    data = os.urandom((5 << 20) + 4096)
    a, b = socket.socketpair()
    t = threading.Thread(target=lambda: (a.sendall(data), a.shutdown(socket.SHUT_WR)))
    t.start()
    check, w = _Check(), _Writer()
    fill_from(b, len(data), w, check, start=8192, buf_bytes=1 << 20)
    t.join(30)
    assert bytes(check.fed) == data
    assert [off for off, _ in w.extents] == [8192 + k * (1 << 20) for k in range(6)]
    assert b"".join(x for _, x in w.extents) == data
    a.close()
    b.close()


def test_fill_from_stops_its_receiving_thread_when_a_piece_fails_its_check():
    a, b = socket.socketpair()
    def send() -> None:
        try:
            a.sendall(os.urandom(3 << 20))
        except OSError:  # the receiver shut its side
            pass
    t = threading.Thread(target=send, daemon=True)
    t.start()  # then the sender goes quiet, the socket open: a receive would block
    w = _Writer()
    before = set(threading.enumerate())
    with pytest.raises(CorruptCheckpoint):
        fill_from(b, 64 << 20, w, _Check(fail_at=1 << 20), buf_bytes=1 << 20)
    assert [off for off, _ in w.extents] == [0]  # the piece before it, never the failed one
    assert not [t for t in set(threading.enumerate()) - before if t.name == "zerostall-peers-recv"]
    b.sendall(b"answer")  # the caller can still answer on the socket
    t.join(10)
    assert a.recv(16) == b"answer"
    a.close()
    b.close()


def test_fill_from_reports_a_cut_transfer():
    a, b = socket.socketpair()
    threading.Thread(target=lambda: (a.sendall(os.urandom(100_000)), a.close()), daemon=True).start()
    with pytest.raises(PeerError, match="cut after 100000 of"):
        fill_from(b, 1 << 20, _Writer(), _Check(), buf_bytes=1 << 20)
    b.close()


def test_send_range_shuts_the_stream_when_the_file_ends_early(tmp_path):
    """A holder's copy truncated under the sender (or unreadable): the receiver sees the cut
    at once, instead of waiting its timeout for bytes that never come (and then reading the
    sender's late error answer as file bytes)."""
    path, data = _file(tmp_path, 1 << 20)
    a, b = socket.socketpair()
    b.settimeout(60)  # a guard only: with the stream shut the receive ends at once
    got, ended = bytearray(), []

    def receive() -> None:
        try:
            _receive_all(b, got)
            ended.append("eof")
        except OSError as exc:
            ended.append(repr(exc))
    t = threading.Thread(target=receive)
    t.start()
    with open(path, "rb", buffering=0) as f:
        sent = send_range(a, f, 0, 2 << 20)  # the connection stays open: the caller's to close
    t.join(90)
    assert (sent, bytes(got), ended) == (1 << 20, data, ["eof"])
    a.close()
    b.close()


def test_send_range_raises_when_the_receiver_takes_nothing_for_its_timeout(tmp_path):
    """A receiver that stopped reading (SIGSTOP, a hung host) will not answer either: the
    sender fails after one timeout instead of waiting a second one for the answer."""
    path, _ = _file(tmp_path, 8 << 20)
    a, b = socket.socketpair()
    a.settimeout(0.2)
    threads = set(threading.enumerate())
    with open(path, "rb", buffering=0) as f, pytest.raises(TimeoutError):
        send_range(a, f, 0, 8 << 20)
    assert not set(threading.enumerate()) - threads  # the read-ahead thread is gone
    assert b.recv(1 << 20)  # what was sent before the stall is there, then the stream is shut
    a.close()
    b.close()


def test_fill_from_a_failing_write_while_every_buffer_is_full_ends_the_receiving_thread():
    """The sender keeps sending, so the receiving thread fills every buffer and waits for one
    back; the write of the first fails (a full disk): the error comes out, nothing hangs."""
    a, b = socket.socketpair()

    def send() -> None:
        try:
            a.sendall(os.urandom(16 << 20))
        except OSError:  # the receiver shut its side
            pass
    t = threading.Thread(target=send, daemon=True)
    t.start()

    class Full(_Writer):
        def write(self, extents, overlap=None):
            raise OSError(28, "No space left on device")
    before = set(threading.enumerate())
    with pytest.raises(OSError, match="No space left"):
        fill_from(b, 16 << 20, Full(), _Check(), buf_bytes=1 << 20)
    assert not [x for x in set(threading.enumerate()) - before if x.name == "zerostall-peers-recv"]
    b.close()
    t.join(30)
    assert not t.is_alive()
    a.close()


def test_fill_from_checks_the_next_piece_while_the_one_before_is_written():
    """With pieces waiting (the disk behind the link), each piece's crc runs while the piece
    before it is being written (the engines' ``overlap``), so the disk does not idle during the
    crc; still no piece is written before it was checked, and a bad piece is never written."""
    data = os.urandom(3 << 20)
    a, b = socket.socketpair()
    sent = threading.Event()
    t = threading.Thread(target=lambda: (a.sendall(data), sent.set()), daemon=True)
    t.start()
    events: list[tuple[str, int]] = []

    before = set(threading.enumerate())

    class Check(_Check):
        def feed(self, mv):
            if not self.fed:  # the receiving thread takes the rest into its other buffers and ends
                assert sent.wait(30)
                for x in set(threading.enumerate()) - before:
                    if x.name == "zerostall-peers-recv":
                        x.join(30)
            events.append(("check", len(self.fed)))
            super().feed(mv)

    class Writer(_Writer):
        def write(self, extents, overlap=None):  # as the engines do: overlap runs while the write is in
            events.append(("write", extents[0][0]))  # flight, its error raised once the write ended
            err = None
            try:
                if overlap is not None:
                    overlap()
            except CorruptCheckpoint as exc:
                err = exc
            super().write(extents)
            events.append(("written", extents[0][0]))
            if err is not None:
                raise err
    check, w = Check(fail_at=None), Writer()
    fill_from(b, len(data), w, check, buf_bytes=1 << 20)
    assert bytes(check.fed) == data and b"".join(x for _, x in w.extents) == data
    mb = 1 << 20
    assert events == [("check", 0), ("write", 0), ("check", mb), ("written", 0), ("write", mb), ("check", 2 * mb),
                      ("written", mb), ("write", 2 * mb), ("written", 2 * mb)]
    a.close()
    b.close()
    # a bad piece found during the write of the one before: that one is written, the bad one never
    a, b = socket.socketpair()
    sent.clear()
    t = threading.Thread(target=lambda: (a.sendall(data), sent.set()), daemon=True)
    t.start()
    events.clear()
    before = set(threading.enumerate())
    w = Writer()
    with pytest.raises(CorruptCheckpoint):
        fill_from(b, len(data), w, Check(fail_at=mb + 1), buf_bytes=1 << 20)
    assert [off for off, _ in w.extents] == [0]
    a.close()
    b.close()
