"""A fixed peer listen port (``PeersConfig.listen_port``, ``ZEROSTALL_PEER_PORT``) for clusters
whose firewalls open only named ports: the server listens on it, a taken port fails with an
error naming it (on the node that cannot bind it and, through the start-up exchange, on every
other rank at once rather than at its timeout)."""

from __future__ import annotations

import socket
import threading

import pytest
from torch.distributed import HashStore

import zerostall
from zerostall.config import CheckpointConfig
from zerostall.distributed.store import Store
from zerostall.errors import ConfigError
from zerostall.peers import exchange
from zerostall.peers.tcp import Pacer, TcpTransport
from zerostall.store.local import LocalTier
from zerostall.peers.store import PeerStore
from zerostall.io.base import choose_engine

SECRET = b"port-test-secret-0123456789"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _transport(port: int) -> TcpTransport:
    return TcpTransport(SECRET, "n1", {"n0", "n1"}, timeout_s=5, pacer=Pacer(None), listen_port=port)


@pytest.mark.parametrize("bad", [-1, 65536, True, "7000", 7000.0])
def test_listen_port_must_be_a_port(bad):
    with pytest.raises(ConfigError, match="peers.listen_port"):
        zerostall.PeersConfig(listen_port=bad)


def test_listen_port_has_an_environment_twin():
    assert CheckpointConfig.from_env(environ={}).peers.listen_port == 0
    assert CheckpointConfig.from_env(environ={"ZEROSTALL_PEER_PORT": "7711"}).peers.listen_port == 7711
    for bad in ("x", "70000"):
        with pytest.raises(ConfigError, match=f"ZEROSTALL_PEER_PORT={bad!r}"):
            CheckpointConfig.from_env(environ={"ZEROSTALL_PEER_PORT": bad})


def test_the_server_listens_on_the_fixed_port_and_a_taken_one_is_named(tmp_path):
    tier = LocalTier(str(tmp_path / "n1"), create=True)
    store = PeerStore(tier, "n1", lambda: choose_engine(tier.root))
    port = _free_port()
    first = _transport(port)
    try:
        assert first.serve(store) == ("127.0.0.1", port)
        second = _transport(port)
        with pytest.raises(ConfigError, match=rf"peers.listen_port={port}: node n1 cannot listen on "
                                              rf"127.0.0.1:{port}.*ZEROSTALL_PEER_PORT"):
            second.serve(store)
        second.close()
    finally:
        first.close()
    eph = _transport(0)
    try:
        assert eph.serve(store)[1] > 0  # 0: a port the kernel picks
    finally:
        eph.close()


def test_a_node_that_cannot_listen_fails_every_rank_of_the_exchange_at_once(monkeypatch):
    """Rank 0 (node a) cannot bind its port; rank 1 (node b) hears it through the store and
    fails with node a's error instead of waiting ``timeout_s`` for a's endpoint."""
    monkeypatch.setattr(exchange, "node_id", lambda: threading.current_thread().name)
    monkeypatch.delenv("ZEROSTALL_PEER_SECRET", raising=False)
    monkeypatch.delenv("ZEROSTALL_PEER_SECRET_FILE", raising=False)
    store = Store(HashStore(), own_client=False)
    errors: dict[str, BaseException] = {}

    def serve_a(secret, me, nodes):
        raise ConfigError("peers.listen_port=7711: node a cannot listen on 0.0.0.0:7711 (Address already in use)")

    def rank(r: int, serve) -> None:
        try:
            exchange.setup(store, "job", r, 2, 2, 120.0, serve)
        except BaseException as exc:  # noqa: BLE001 - collected for the asserts
            errors[threading.current_thread().name] = exc

    ts = [threading.Thread(target=rank, args=(0, serve_a), name="a"),
          threading.Thread(target=rank, args=(1, lambda s, m, n: ("127.0.0.1", 1)), name="b")]
    for t in ts:
        t.start()
    for t in ts:
        t.join(60)
    assert not any(t.is_alive() for t in ts)
    assert isinstance(errors["a"], ConfigError) and "7711" in str(errors["a"])
    assert isinstance(errors["b"], ConfigError)
    assert "node a's peer server did not start" in str(errors["b"]) and "7711" in str(errors["b"])


def test_a_port_that_is_not_a_number_is_named_once_with_what_to_set():
    for bad in ("x", "", "7700.0"):
        with pytest.raises(ConfigError) as got:
            CheckpointConfig.from_env(environ={"ZEROSTALL_PEER_PORT": bad})
        msg = str(got.value)
        assert msg.count("ZEROSTALL_PEER_PORT") == 1 and "1..65535" in msg, msg


def test_an_address_that_is_not_this_hosts_is_not_blamed_on_a_taken_port(tmp_path):
    """192.0.2.1 (TEST-NET-1) is no address of this host: the error says to fix
    peers.listen_host, not that another process holds the port; with port 0 too (a ConfigError
    the start-up exchange hands to every rank, not a bare OSError they wait out)."""
    tier = LocalTier(str(tmp_path / "n1"), create=True)
    store = PeerStore(tier, "n1", lambda: choose_engine(tier.root))
    for port in (_free_port(), 0):
        t = TcpTransport(SECRET, "n1", {"n0", "n1"}, timeout_s=5, pacer=Pacer(None), listen_host="192.0.2.1",
                         listen_port=port)
        try:
            with pytest.raises(ConfigError) as got:
                t.serve(store)
        finally:
            t.close()
        msg = str(got.value)
        assert "192.0.2.1" in msg and "peers.listen_host" in msg and "another process" not in msg, msg
