"""The peer transport's door, on real sockets in one process: a hostile handshake is refused
and logged and the server keeps serving the job's own peers; a low bandwidth cap never starves
a holder into its ``peers.timeout_s``."""

import json
import logging
import os
import socket
import struct

import pytest
import torch

import zerostall
from zerostall.errors import ConfigError
from zerostall.io.base import choose_engine
from zerostall.peers.store import PeerStore
from zerostall.peers.tcp import Pacer, TcpTransport
from zerostall.peers.wire import Endpoint
from zerostall.peers.wire import recv_msg
from zerostall.store.local import LocalTier

SECRET = b"s" * 32
NAME = "rank-00000.shard"


def _server(tmp_path, **kw):
    dst = LocalTier(str(tmp_path / "n1"), create=True)
    server = TcpTransport(SECRET, "n1", {"n0", "n1"}, timeout_s=kw.pop("timeout_s", 5), pacer=Pacer(None), **kw)
    host, port = server.serve(PeerStore(dst, "n1", lambda: choose_engine(dst.root)))
    return dst, server, Endpoint("n1", host, port)


def test_a_deeply_nested_handshake_is_refused_logged_and_the_server_serves_on(tmp_path, caplog):
    dst, server, ep = _server(tmp_path)
    client = TcpTransport(SECRET, "n0", {"n0", "n1"}, timeout_s=5, pacer=Pacer(None))
    try:
        caplog.set_level(logging.WARNING, logger="zerostall")
        for body in (b"[" * 200_000 + b"]" * 200_000,  # 400 kB of nesting: past json's recursion limit
                     b"[" * 2000 + b"]" * 2000,  # nested as deep, small enough for a handshake
                     b'{"node":"n0","nonce":"' + b"a" * 32 + b'","mac":"' + b"m" * 300_000 + b'"}'):
            with socket.create_connection((ep.host, ep.port), timeout=5) as s:
                hello = recv_msg(s)
                assert hello["node"] == "n1"
                s.sendall(struct.pack(">I", len(body)) + body)
                s.settimeout(5)
                try:
                    while s.recv(65536):  # the server answers (or not) and closes
                        pass
                except OSError:
                    pass
        refusals = [r.getMessage() for r in caplog.records if "refused" in r.getMessage()]
        assert len(refusals) == 3 and server.refused == 3, refusals
        assert all("handshake refused" in r for r in refusals), refusals
        assert "nested deeper" in refusals[1] and "bytes refused" in refusals[0] + refusals[2], refusals
        assert client.list_held(ep) == []  # a legitimate peer is served afterwards
    finally:
        client.close()
        server.close()


class _Clock:
    """A fake clock for the pacer (its ``time`` module): sleeping advances it; records sends."""

    def __init__(self):
        self.now, self.events = 0.0, []

    def monotonic(self):
        return self.now

    def sleep(self, s):
        self.events.append(("sleep", self.now, s))
        self.now += s


def test_a_low_bandwidth_cap_sends_before_it_sleeps_and_no_holder_times_out(tmp_path, monkeypatch):
    """2 MiB/s with a 5 s peers.timeout_s (the pair of the report): two 12 MiB copies back to
    back through one sender's pacer, as two steps' copies go, on a real socket. A holder sees
    no progress between two pieces for longer than its timeout would refuse the copy: every
    pause between sends stays well within it, the first byte of each copy included."""
    from zerostall.peers import stream
    clock = _Clock()
    monkeypatch.setattr(stream, "time", clock)
    path = tmp_path / "f"
    path.write_bytes(os.urandom(12 << 20))
    pacer = Pacer(2 << 20, timeout_s=5.0)
    a, b = socket.socketpair()
    got = []

    def drain():
        while (k := len(b.recv(1 << 20))):
            got.append(k)
    t = __import__("threading").Thread(target=drain, daemon=True)
    t.start()
    sends = []

    class _Sock:  # the sender's socket, each send's moment recorded
        def send(self, data):
            sends.append(clock.now)
            return a.send(data)
    with open(path, "rb") as f:
        for _ in range(2):
            assert stream.send_range(_Sock(), f, 0, 12 << 20, pacer) == 12 << 20
    a.close()
    t.join(10)
    b.close()
    assert sum(got) == 24 << 20
    gaps = [y - x for x, y in zip(sends, sends[1:])]
    assert sends[0] == 0.0 and max(gaps) <= 5.0 / 2, (sends, clock.events)
    assert clock.now >= (24 << 20) / (2 << 20) - 1  # still paced: 24 MiB at 2 MiB/s


def test_a_cap_too_low_for_the_timeout_is_refused_at_config_time():
    with pytest.raises(ConfigError, match=r"peers.bandwidth_bytes.*peers.timeout_s"):
        zerostall.PeersConfig(bandwidth_bytes=1 << 20, timeout_s=0.5)
    with pytest.raises(ConfigError, match=r"peers.receive_bandwidth_bytes.*peers.timeout_s"):
        zerostall.PeersConfig(receive_bandwidth_bytes=1 << 20, timeout_s=0.5)
    zerostall.PeersConfig(bandwidth_bytes=2 << 20, timeout_s=5)  # the pair of the report: fine


def test_the_peer_secret_comes_from_the_launcher_and_a_loose_file_is_refused(tmp_path, monkeypatch):
    """``ZEROSTALL_PEER_SECRET_FILE`` must be this user's and readable by it alone; the key the
    handshake uses is derived per session and never equals what the launcher gave."""
    from zerostall.peers import exchange
    monkeypatch.delenv(exchange.SECRET_ENV, raising=False)
    monkeypatch.delenv(exchange.SECRET_FILE_ENV, raising=False)
    assert exchange.given_secret() is None  # the store fallback (warned at start-up)
    f = tmp_path / "secret"
    f.write_text("0123456789abcdef-the-job\n")
    os.chmod(f, 0o644)
    monkeypatch.setenv(exchange.SECRET_FILE_ENV, str(f))
    with pytest.raises(ConfigError, match=r"ZEROSTALL_PEER_SECRET_FILE=.*chmod 600"):
        exchange.given_secret()
    os.chmod(f, 0o600)
    assert exchange.given_secret() == b"0123456789abcdef-the-job"
    k1, k2 = exchange.session_key(b"0123456789abcdef-the-job", "a"), exchange.session_key(b"0123456789abcdef-the-job", "b")
    assert k1 != k2 and b"0123456789abcdef" not in k1 and exchange.fingerprint(k1) not in (k1.hex(), k2.hex())
    monkeypatch.delenv(exchange.SECRET_FILE_ENV)
    monkeypatch.setenv(exchange.SECRET_ENV, "short")
    with pytest.raises(ConfigError, match="at least 16"):
        exchange.given_secret()
