"""One file fetched from several holders at once (byte ranges cut at tensor boundaries, each
checked against the manifest), a holder dying mid-range, the holder's quota and its receive-side
pacing: real sockets, real O_DIRECT files, one process (the servers run on their own threads)."""

import importlib
import logging
import os
import types

import pytest
import torch

import zerostall
from zerostall.errors import CheckpointNotFound, ConfigError, CorruptCheckpoint
from zerostall.io.base import choose_engine
from zerostall.peers.store import PeerStore, quota_for
from zerostall.peers.tcp import Pacer, TcpTransport
from zerostall.peers.wire import Endpoint
from zerostall.peers.verify import StreamCheck, ranges, split_points
from zerostall.peers.wire import PeerError
from zerostall.store.local import LocalTier

SECRET = b"r" * 32
NAME = "rank-00000.shard"
fetch_mod = importlib.import_module("zerostall.peers.fetch")  # the package exports a function of that name
tcp_mod = importlib.import_module("zerostall.peers.tcp")
NODES = {"n0", "n1", "n2", "n3"}


class _Recorder(Pacer):
    def __init__(self):
        super().__init__(None)
        self.taken = 0

    def take(self, n):
        self.taken += n


@pytest.fixture
def job(tmp_path):
    """n0's committed step 1 (eight 256 KiB tensors), held by n1 and n2 (real puts)."""
    yield from _job(tmp_path, {f"t{i}": torch.randn(65536) for i in range(8)} | {"meta": {"k": 1}})


def _job(tmp_path, state):
    src = str(tmp_path / "n0")
    zerostall.save(src, state, 1)
    servers, eps, stores = {}, {}, {}
    for node in ("n1", "n2"):
        tier = LocalTier(str(tmp_path / node), create=True)
        rec = _Recorder()
        server = TcpTransport(SECRET, node, NODES, timeout_s=5, pacer=Pacer(None), recv_pacer=rec)
        stores[node] = PeerStore(tier, node, lambda t=tier: choose_engine(t.root))
        host, port = server.serve(stores[node])
        servers[node], eps[node] = server, Endpoint(node, host, port)
    client = TcpTransport(SECRET, "n0", NODES, timeout_s=5, pacer=Pacer(None))
    srct = LocalTier(src)
    raw = open(os.path.join(srct.step_dir(1), "manifest.json"), "rb").read()
    for node in ("n1", "n2"):
        client.put(eps[node], "n0", 1, NAME, os.path.join(srct.step_dir(1), NAME), raw)
    me = TcpTransport(SECRET, "n3", NODES, timeout_s=5, pacer=Pacer(None))
    try:
        yield types.SimpleNamespace(src=srct, servers=servers, eps=eps, stores=stores, client=me, tmp=tmp_path,
                                    view=types.SimpleNamespace(endpoints=eps), man=srct.read_manifest(1))
    finally:
        for t in [client, me, *servers.values()]:
            t.close()


def _fetch(job, holders, monkeypatch):
    monkeypatch.setattr(fetch_mod, "RANGE_MIN_BYTES", 4096)
    out = str(job.tmp / "back")
    os.makedirs(out, exist_ok=True)
    path = os.path.join(out, NAME)
    man = fetch_mod._fetch_file(job.view, job.client, lambda: choose_engine(out), 1, NAME, holders, path)
    return path, man


def _orig(job):
    return open(os.path.join(job.src.step_dir(1), NAME), "rb").read()


def test_ranges_cut_at_tensor_starts_and_cover_the_file(job):
    man = job.man
    size = next(f.file_bytes for f in man.files if f.name == NAME)
    pts = split_points(man, NAME)
    starts = sorted(e.offset for e in man.tensors if e.file == NAME and e.step is None)
    assert pts == starts[1:] and pts
    rs = ranges(man, NAME, 3, 4096)
    assert len(rs) == 3 and rs[0][0] == 0 and rs[-1][1] == size
    assert all(a[1] == b[0] for a, b in zip(rs, rs[1:])) and all(b[0] in pts for b in rs[1:])
    data = memoryview(_orig(job))
    for a, b in rs:  # each range checks on its own
        check = StreamCheck(man, NAME, "x", a, b)
        check.feed(data[a:b])
        check.digest()
    with pytest.raises(CorruptCheckpoint, match="not a range"):
        StreamCheck(man, NAME, "x", pts[0] + 4096, size)


def test_one_file_from_two_holders_in_parallel_bit_exact(job, monkeypatch, caplog):
    caplog.set_level(logging.INFO, logger="zerostall")
    path, man = _fetch(job, [("n1", "n0"), ("n2", "n0")], monkeypatch)
    assert open(path, "rb").read() == _orig(job)
    assert man.checkpoint_id == job.man.checkpoint_id
    served = [r.getMessage() for r in caplog.records if "served by peer" in r.getMessage()]
    assert any("peer n1" in m for m in served) and any("peer n2" in m for m in served), served
    assert all("bytes" in m for m in served)


def test_packed_small_tensors_split_and_fetched_bit_exact(tmp_path, monkeypatch):
    """Small tensors share pages (packed layout); ranges start only where no tensor crosses."""
    state = {f"s{i}": torch.arange(i % 50 + 1, dtype=torch.float32) for i in range(3000)}
    state |= {f"big{i}": torch.randn(40000) for i in range(4)}
    gen = _job(tmp_path, state)
    job = next(gen)
    try:
        assert len(ranges(job.man, NAME, 2, 4096)) == 2
        path, _ = _fetch(job, [("n1", "n0"), ("n2", "n0")], monkeypatch)
        assert open(path, "rb").read() == _orig(job)
    finally:
        gen.close()


def test_a_holder_dying_mid_range_is_replaced_for_that_range_only(job, monkeypatch, caplog):
    caplog.set_level(logging.INFO, logger="zerostall")
    real = tcp_mod.send_range
    dying = job.eps["n1"].port

    def cut(sock, f, offset, length, pacer=None):
        if sock.getsockname()[1] == dying and length:  # n1 sends half its range, then its connection dies
            real(sock, f, offset, length // 2 // 4096 * 4096, pacer)
            sock.close()
            return 0
        return real(sock, f, offset, length, pacer)
    monkeypatch.setattr(tcp_mod, "send_range", cut)
    path, _ = _fetch(job, [("n1", "n0"), ("n2", "n0")], monkeypatch)
    assert open(path, "rb").read() == _orig(job)
    msgs = [r.getMessage() for r in caplog.records]
    assert any("from node n1 failed" in m for m in msgs)
    assert not any("served by peer n1" in m for m in msgs)
    assert sum("served by peer n2" in m for m in msgs) == 2


def test_a_flipped_byte_in_one_holders_range_is_caught_and_fetched_elsewhere(job, monkeypatch, caplog):
    held = os.path.join(job.stores["n1"].step_dir("n0", 1), NAME)
    data = bytearray(open(held, "rb").read())
    last = max(e.offset for e in job.man.tensors if e.file == NAME and e.step is None)
    data[last + 5] ^= 0x10  # n1's copy of the last tensor rots after it was verified
    with open(held, "r+b") as f:
        f.write(data)
    caplog.set_level(logging.INFO, logger="zerostall")
    path, _ = _fetch(job, [("n2", "n0"), ("n1", "n0")], monkeypatch)  # n1 serves the second range
    assert open(path, "rb").read() == _orig(job)
    assert any("crc32c" in r.getMessage() and "n1" in r.getMessage() for r in caplog.records)


def test_every_holder_failing_a_range_fails_the_file(job, monkeypatch):
    for node in ("n1", "n2"):
        held = os.path.join(job.stores[node].step_dir("n0", 1), NAME)
        data = bytearray(open(held, "rb").read())
        data[-4096 + 7] ^= 1  # both copies damaged in the last range (padding or bytes: refused)
        open(held, "r+b").write(data)
    with pytest.raises(CheckpointNotFound):
        _fetch(job, [("n1", "n0"), ("n2", "n0")], monkeypatch)


def test_range_requests_must_start_at_a_tensor(job):
    bad = split_points(job.man, NAME)[0] + 4096
    with pytest.raises(PeerError, match="where a tensor starts"):
        job.client.get(job.eps["n1"], "n0", 1, NAME, lambda m, s: (None, None), rng=(bad, bad + 4096))


def test_quota_refuses_a_copy_beyond_it_and_logs_it(job, caplog, tmp_path):
    size = next(f.file_bytes for f in job.man.files if f.name == NAME)
    tier = LocalTier(str(tmp_path / "q"), create=True)
    store = PeerStore(tier, "n3", lambda: choose_engine(tier.root), quota_bytes=size + 10_000)
    server = TcpTransport(SECRET, "n3", NODES, timeout_s=5, pacer=Pacer(None))
    ep = Endpoint("n3", *server.serve(store))
    client = TcpTransport(SECRET, "n0", NODES, timeout_s=5, pacer=Pacer(None))
    raw = open(os.path.join(job.src.step_dir(1), "manifest.json"), "rb").read()
    path = os.path.join(job.src.step_dir(1), NAME)
    try:
        client.put(ep, "n0", 1, NAME, path, raw)  # fits
        client.put(ep, "n0", 1, NAME, path, raw)  # the same copy again: replaces itself, fits
        assert store.used_bytes() <= size + 10_000
        caplog.set_level(logging.WARNING, logger="zerostall")
        zerostall.save(job.src.root, {"t": torch.randn(65536)}, 2)
        raw2 = open(os.path.join(job.src.step_dir(2), "manifest.json"), "rb").read()
        with pytest.raises(PeerError, match="quota"):
            client.put(ep, "n0", 2, NAME, os.path.join(job.src.step_dir(2), NAME), raw2)
        assert store.refused_quota == 1
        assert any("beyond its quota" in r.getMessage() for r in caplog.records)
        assert not os.path.exists(store.step_dir("n0", 2)) or \
            not [f for f in os.listdir(store.step_dir("n0", 2)) if f.endswith(".shard") or f.startswith(".incoming")]
        assert [(h["step"], h["files"]) for h in client.list_held(ep) if h["src"] == "n0"] == [(1, [NAME])]
    finally:
        client.close()
        server.close()


def test_quota_fraction_of_the_filesystem(tmp_path):
    st = os.statvfs(tmp_path)
    assert quota_for(str(tmp_path), None, 0.5) == int(st.f_blocks * st.f_frsize * 0.5)
    assert quota_for(str(tmp_path), 1000, 0.5) == 1000
    assert quota_for(str(tmp_path), None, None) is None
    with pytest.raises(ConfigError, match="quota_fraction"):
        zerostall.PeersConfig(quota_fraction=1.5)


def test_holder_paces_what_it_takes_in(job):
    size = next(f.file_bytes for f in job.man.files if f.name == NAME)
    for node in ("n1", "n2"):  # every byte each holder received went through its own pacer
        assert job.servers[node].recv_pacer.taken == size
