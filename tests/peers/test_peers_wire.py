"""The peer transport on real sockets and the real disk, in one process: a committed step of one
node's root copied to another node's server, verified byte by byte; corrupt, cut, foreign and
hostile transfers refused without harm."""

import logging
import os
import socket
import threading
import time

import pytest
import torch

import zerostall
from tests.helpers import flip_byte
from zerostall.errors import ConfigError
from zerostall.format.layout import HEADER_BYTES
from zerostall.io.base import choose_engine
from zerostall.peers.exchange import Node, holders, ranking
from zerostall.peers.store import PeerStore
from zerostall.peers.tcp import Pacer, TcpTransport
from zerostall.peers.wire import Endpoint
from zerostall.peers.verify import StreamCheck, expected_digest
from zerostall.peers.wire import PeerError, client_handshake, recv_msg, send_msg
from zerostall.store.local import LocalTier

SECRET = b"s" * 32
NAME = "rank-00000.shard"


@pytest.fixture
def pair(tmp_path):
    """Node n0's committed step 1 (a real save), node n1's peer server over its own root."""
    src = str(tmp_path / "n0")
    state = {"w": torch.randn(300_000), "b": torch.arange(1000, dtype=torch.int64), "meta": {"lr": 0.1}}
    zerostall.save(src, state, 1)
    dst = LocalTier(str(tmp_path / "n1"), create=True)
    server = TcpTransport(SECRET, "n1", {"n0", "n1", "n2"}, timeout_s=5, pacer=Pacer(None))
    store = PeerStore(dst, "n1", lambda: choose_engine(dst.root))
    host, port = server.serve(store)
    client = TcpTransport(SECRET, "n0", {"n0", "n1", "n2"}, timeout_s=5, pacer=Pacer(None))
    yield LocalTier(src), dst, Endpoint("n1", host, port), server, client
    client.close()
    server.close()


def _put(src, client, ep):
    path = os.path.join(src.step_dir(1), NAME)
    raw = open(os.path.join(src.step_dir(1), "manifest.json"), "rb").read()
    return client.put(ep, "n0", 1, NAME, path, raw)


def _area(dst):
    out = []
    for d, _, files in os.walk(os.path.join(dst.root, "peers")):
        out += [os.path.relpath(os.path.join(d, f), dst.root) for f in files]
    return sorted(out)


def test_put_list_get_round_trip_bit_exact(pair, tmp_path):
    src, dst, ep, server, client = pair
    digest = _put(src, client, ep)
    man = src.read_manifest(1)
    assert digest == expected_digest(man, NAME)
    held = os.path.join(dst.root, "peers", "n0", "step-1", NAME)
    assert open(held, "rb").read() == open(os.path.join(src.step_dir(1), NAME), "rb").read()
    listed = client.list_held(ep)
    assert [(h["src"], h["step"], h["files"]) for h in listed] == [("n0", 1, [NAME])]
    out = str(tmp_path / "back")
    os.makedirs(out)
    eng = choose_engine(out)
    opened = []

    def sink(m, size):
        w = eng.open_write(os.path.join(out, NAME), size)
        opened.append(w)
        return w, StreamCheck(m, NAME, "back")
    assert client.get(ep, "n0", 1, NAME, sink) == digest
    opened[0].finish()
    opened[0].close()
    assert open(os.path.join(out, NAME), "rb").read() == open(held, "rb").read()


def test_flipped_byte_is_refused_and_never_acknowledged(pair):
    src, dst, ep, server, client = pair
    man = src.read_manifest(1)
    e = max(man.tensors, key=lambda t: t.nbytes)
    flip_byte(os.path.join(src.step_dir(1), NAME), e.offset + e.nbytes // 2)
    with pytest.raises(PeerError, match="crc32c"):
        _put(src, client, ep)
    assert _area(dst) == ["peers/n0/step-1/manifest.json"]  # no shard, no .incoming left


def test_padding_and_header_bytes_are_checked_too(pair):
    src, dst, ep, server, client = pair
    flip_byte(os.path.join(src.step_dir(1), NAME), 100)  # inside the header block
    with pytest.raises(PeerError, match="header"):
        _put(src, client, ep)
    flip_byte(os.path.join(src.step_dir(1), NAME), 100)
    man = src.read_manifest(1)
    e = min(man.tensors, key=lambda t: t.offset)
    if (e.offset + e.nbytes) % 4096:  # a padding byte after the first tensor
        flip_byte(os.path.join(src.step_dir(1), NAME), e.offset + e.nbytes)
        with pytest.raises(PeerError, match="padding"):
            _put(src, client, ep)
    assert NAME not in str(_area(dst))


def _raw(ep, secret=SECRET, node="n0"):
    s = socket.create_connection((ep.host, ep.port), timeout=5)
    client_handshake(s, secret, node)
    return s


def _wait_refused(server, n):
    deadline = time.monotonic() + 10
    while server.refused < n and time.monotonic() < deadline:
        time.sleep(0.02)
    return server.refused


def test_transfer_cut_midway_leaves_nothing(pair):
    src, dst, ep, server, client = pair
    path = os.path.join(src.step_dir(1), NAME)
    raw = open(os.path.join(src.step_dir(1), "manifest.json"), "rb").read()
    data = open(path, "rb").read()
    s = _raw(ep)
    send_msg(s, {"op": "put", "src": "n0", "step": 1, "name": NAME, "size": len(data), "manifest_bytes": len(raw)})
    s.sendall(raw + data[:len(data) // 2])
    s.close()
    assert _wait_refused(server, 1) == 1
    assert _area(dst) == ["peers/n0/step-1/manifest.json"]
    assert _put(src, client, ep)  # the next, complete transfer is held
    assert "peers/n0/step-1/" + NAME in _area(dst)


def test_foreign_client_is_refused_and_logged(pair, caplog):
    src, dst, ep, server, client = pair
    with caplog.at_level(logging.WARNING, logger="zerostall"):
        with pytest.raises(PeerError, match="refused"):
            _raw(ep, secret=b"x" * 32)
        assert _wait_refused(server, 1) == 1
    assert any("refused" in r.getMessage() and "authentication failed" in r.getMessage() for r in caplog.records)
    stranger = TcpTransport(b"y" * 32, "n2", {"n0", "n1", "n2"}, timeout_s=5, pacer=Pacer(None))
    with pytest.raises(PeerError):
        stranger.list_held(ep)
    # and a stranger's *server* is not trusted by our client either
    with pytest.raises(PeerError):
        client.list_held(Endpoint("n1", ep.host, _stranger_port(dst)))
    assert _put(src, client, ep)  # the server still serves the job


def _stranger_port(dst):
    t = TcpTransport(b"z" * 32, "n1", {"n0", "n1"}, timeout_s=5, pacer=Pacer(None))
    return t.serve(PeerStore(dst, "n1", lambda: choose_engine(dst.root)))[1]


@pytest.mark.parametrize("bad", [
    {"src": "../../etc"}, {"src": "n1"}, {"src": "nX"}, {"src": "n2"}, {"step": -1}, {"step": "1"}, {"step": 2},
    {"name": "../manifest.json"}, {"name": "rank-00001.shard"}, {"size": 1 << 60}, {"size": 4096},
    {"manifest_bytes": 1 << 40}, {"op": "rm"},
])
def test_hostile_requests_are_refused_without_harm(pair, bad):
    src, dst, ep, server, client = pair
    path = os.path.join(src.step_dir(1), NAME)
    raw = open(os.path.join(src.step_dir(1), "manifest.json"), "rb").read()
    msg = {"op": "put", "src": "n0", "step": 1, "name": NAME, "size": os.path.getsize(path),
           "manifest_bytes": len(raw), **bad}
    s = _raw(ep)
    send_msg(s, msg)
    try:
        s.sendall(raw)
        reply = recv_msg(s)
    except (OSError, PeerError):
        reply = {"ok": False}
    s.close()
    assert reply.get("ok") is False
    assert _wait_refused(server, 1) == 1
    assert not any(f.endswith(".shard") or ".incoming" in f for f in _area(dst))
    assert sorted(os.listdir(dst.root)) in ([], ["peers"])
    assert _put(src, client, ep)  # still serving


def test_get_serves_only_committed_files(pair):
    src, dst, ep, server, client = pair
    os.makedirs(os.path.join(dst.root, "step-7.partial"))
    open(os.path.join(dst.root, "step-7.partial", NAME), "wb").write(b"\0" * 8192)
    for src_node, step in (("n1", 7), ("n0", 1), ("n1", 1)):
        with pytest.raises(PeerError, match="not held"):
            client.get(ep, src_node, step, NAME, lambda m, n: (_ for _ in ()).throw(AssertionError))


def test_a_stopped_peer_fails_the_call_within_the_timeout(tmp_path):
    silent = socket.create_server(("127.0.0.1", 0))  # accepts into its backlog, never answers
    try:
        client = TcpTransport(SECRET, "n0", {"n0", "n1"}, timeout_s=0.5, pacer=Pacer(None))
        with pytest.raises(PeerError, match="timed out"):
            client.list_held(Endpoint("n1", "127.0.0.1", silent.getsockname()[1]))
    finally:
        silent.close()


def test_placement_is_deterministic_distinct_and_spread_over_domains():
    nodes = [Node(f"n{i}", f"rack{i // 2}") for i in range(8)]  # 4 racks of 2 neighbours
    for n in nodes:
        h = holders(n.name, nodes, 3)
        assert h == holders(n.name, list(reversed(nodes)), 3)  # order of the list does not matter
        assert len(set(h)) == 2 and n.name not in h
        doms = {n.domain} | {m.domain for m in nodes if m.name in h}
        assert len(doms) == 3  # three copies in three racks: any two racks can burn
    # not neighbours only: across sources, holders are not just the next node in the list
    assert {holders(n.name, nodes, 2)[0] for n in nodes} != {nodes[(i + 1) % 8].name for i in range(8)}
    # fewer domains than copies: still distinct nodes
    two_racks = [Node(f"n{i}", f"r{i % 2}") for i in range(4)]
    assert len(set(holders("n0", two_racks, 3))) == 2
    assert [x.name for x in ranking("n0", two_racks)][0] in ("n1", "n3")  # the other rack first
    with pytest.raises(ConfigError, match="needs at least 5 nodes"):
        holders("n0", nodes[:4], 5)


def test_stream_check_rejects_short_and_long_files(pair):
    src, *_ = pair
    man = src.read_manifest(1)
    data = open(os.path.join(src.step_dir(1), NAME), "rb").read()
    c = StreamCheck(man, NAME, "x")
    c.feed(memoryview(data[:HEADER_BYTES * 2]))
    with pytest.raises(zerostall.errors.CorruptCheckpoint, match="bytes received"):
        c.digest()
    c = StreamCheck(man, NAME, "x")
    with pytest.raises(zerostall.errors.CorruptCheckpoint, match="more than"):
        c.feed(memoryview(data + b"\0" * 4096))


def test_replicas_config_errors_name_the_value(tmp_path):
    for bad in (0, 17, "2", True):
        with pytest.raises(ConfigError, match="replicas"):
            zerostall.CheckpointConfig(replicas=bad)
    with pytest.raises(ConfigError, match="peers.timeout_s"):
        zerostall.PeersConfig(timeout_s=0)
    with pytest.raises(ConfigError, match="replicas=2 needs a distributed job"):
        zerostall.Checkpointer(str(tmp_path / "c"), replicas=2)
    with zerostall.Checkpointer(str(tmp_path / "c")) as ck:  # the root was not left locked
        assert ck._peers is None


def test_strangers_that_never_authenticate_cannot_lock_the_job_out(pair):
    """adv1: a foreign client opens as many connections as the server allows and never answers
    the greeting. The job's own peers must still get in (their copies and restores are what the
    server is for); today every slot is held by a stranger until peers.timeout_s runs out, and a
    stranger that reconnects keeps the job out for good."""
    src, dst, ep, server, client = pair
    squat = []
    try:
        for _ in range(server.max_connections):
            s = socket.create_connection((ep.host, ep.port), timeout=5)
            assert recv_msg(s)["node"] == "n1"  # accepted: the server greeted it and holds a slot for it
            squat.append(s)
        assert client.list_held(ep) == []  # a job's peer is served all the same
    finally:
        for s in squat:
            s.close()


def test_a_nodes_own_outgoing_connections_do_not_take_its_servers_slots(pair, tmp_path):
    """adv: at a load every node lists every other node at once (one thread each), so a job of
    more than ``max_connections`` nodes has that many of its own connections open while the
    others list it. Those are not connections to its server: they must not make it refuse
    the peers asking it ("the peer closed the connection after 0 of 4 bytes"), which leaves
    their copies uncounted and the restore falling back to an older step."""
    src, dst, ep, server, client = pair
    other_root = LocalTier(str(tmp_path / "n2"), create=True)
    other = TcpTransport(SECRET, "n2", {"n0", "n1", "n2"}, timeout_s=5, pacer=Pacer(None))
    eo = Endpoint("n2", *other.serve(PeerStore(other_root, "n2", lambda: choose_engine(other_root.root))))
    out = []
    try:
        for _ in range(server.max_connections):  # n1 (the server of the pair) busy asking n2
            out.append(server.open(eo))
        assert client.list_held(ep) == []  # n0 asking n1 is served all the same
    finally:
        for s in out:
            server.release(s)
        other.close()


@pytest.mark.xfail(strict=True, reason="adv: a peer arriving while every slot (peers max_connections, 32) is held "
                   "by authenticated peers is refused at once and the client does not retry; at a load every rank "
                   "lists every node at once, so a job of more than 32 ranks outside a node can leave some ranks' "
                   "copies uncounted (a wait in the accept loop alone made clients behind it time out in the "
                   "handshake on this 2-core machine: needs a client retry or one listing per node)")
def test_a_peer_arriving_while_every_slot_is_busy_waits_for_one_instead_of_being_refused(pair):
    """adv: every rank of every node lists every node at a load (hundreds at once in a large
    job), more than ``max_connections``. A job's peer arriving while every slot is held by
    authenticated peers must be served once one frees (within peers.timeout_s), not refused:
    a refused listing leaves that rank's copies uncounted and the restore falls back."""
    src, dst, ep, server, client = pair
    server.max_connections = 1
    busy = client.open(ep)  # the one slot, held by an authenticated peer for a moment
    t = threading.Timer(0.5, client.release, args=(busy,))
    t.start()
    try:
        assert client.list_held(ep) == []
    finally:
        t.join()
