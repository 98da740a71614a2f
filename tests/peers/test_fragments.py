"""Coded copies on real sockets and the real disk, in one process: node n0's committed step cut
into RS(2,1) fragments sent to three holder servers (n1..n3), each fragment checked before the
holder commits it; a wiped n0 rebuilt bit-exact from any two; a wrong byte and a transfer cut
at each of its states handled without harm."""

import os
import signal
import threading
import time

import pytest
import torch

import zerostall
from tests.helpers import flip_byte
from zerostall.errors import CheckpointNotFound
from zerostall.format.manifest import MANIFEST_NAME
from zerostall.io.base import choose_engine
from zerostall.peers import stream
from zerostall.peers.coded import CodedReplicator
from zerostall.peers.coded_restore import holdings, rebuild
from zerostall.peers.exchange import PeerView
from zerostall.peers.fragments import HEADER, FragmentStore, register
from zerostall.peers.exchange import Node
from zerostall.peers.store import PeerStore
from zerostall.peers.tcp import Pacer, TcpTransport
from zerostall.peers.wire import Endpoint
from zerostall.store.local import LocalTier

SECRET = b"s" * 32
NODES = ["n0", "n1", "n2", "n3"]
NAME = "rank-00000.shard"


class Job:
    """n0's root with committed steps, holder servers n1..n3, n0's coded replicator (not started)."""

    def __init__(self, tmp_path):
        self.tmp = tmp_path
        self.src = str(tmp_path / "n0")
        self.servers, self.eps = {}, {}
        for n in NODES[1:]:
            tier = LocalTier(str(tmp_path / n), create=True)
            t = TcpTransport(SECRET, n, set(NODES), timeout_s=3, pacer=Pacer(None))
            ps = PeerStore(tier, n, lambda tier=tier: choose_engine(tier.root))
            register(t, FragmentStore(ps), set(NODES), n, "normal", None)
            host, port = t.serve(ps)
            self.servers[n] = (t, ps)
            self.eps[n] = Endpoint(n, host, port)
        self.client = TcpTransport(SECRET, "n0", set(NODES), timeout_s=3, pacer=Pacer(None))

    def save(self, step):
        g = torch.Generator().manual_seed(step)
        state = {"w": torch.randn(200_000, generator=g), "b": torch.arange(5000 + step), "meta": {"s": step}}
        zerostall.save(self.src, state, step)
        return state

    def view(self):
        return PeerView("p", 0, 1, "n0", tuple(Node(n, n) for n in NODES), ("n0",), dict(self.eps), SECRET)

    def replicator(self):
        tier = LocalTier(self.src)
        return CodedReplicator(tier, self.view(), self.client, None, None, replicas=1, keep_last=None,
                               replica_timeout_s=30, data_fragments=2, parity_fragments=1)

    def send(self, rep, step, plan=None):
        rep.view = self.view()  # the holders' endpoints now
        tier = LocalTier(self.src)
        raw = open(os.path.join(tier.step_dir(step), MANIFEST_NAME), "rb").read()
        lay = rep._layout(tier.read_manifest(step))
        return rep._code_and_send(step, lay, raw, lay.describe(step, tier.read_manifest(step).checkpoint_id, "n0"),
                                  plan or {0: "n1", 1: "n2", 2: "n3"})

    def fragment(self, holder, step, i):
        return os.path.join(str(self.tmp / holder), "peers", "n0", f"step-{step}", f"fragment-{i}")

    def restore_into(self, root):
        """n0 replaced by an empty root: rebuild its newest coded step there."""
        tier = LocalTier(root, create=True)
        coded = holdings(self.view(), self.client)
        step = max(coded)
        rebuild(self.view(), self.client, tier, lambda: choose_engine(root), step, coded)
        return tier, step

    def close(self, rep=None):
        if rep is not None:
            rep._stop.set()
        self.client.close()
        for t, _ in self.servers.values():
            t.close()


@pytest.fixture
def job(tmp_path):
    j = Job(tmp_path)
    yield j
    j.close()


def test_fragments_sent_checked_held_and_rebuilt_bit_exact_from_any_two(job, tmp_path):
    job.save(1)
    rep = job.replicator()
    ok, failed = job.send(rep, 1)
    assert ok == {0: "n1", 1: "n2", 2: "n3"} and not failed
    shard = open(os.path.join(job.src, "step-1", NAME), "rb").read()
    lay = rep._layout(LocalTier(job.src).read_manifest(1))
    fb = lay.fragment_bytes
    # systematic: the data fragments are the file's bytes (zero padded), behind a header block
    d0 = open(job.fragment("n1", 1, 0), "rb").read()
    d1 = open(job.fragment("n2", 1, 1), "rb").read()
    assert len(d0) == len(d1) == HEADER + fb
    assert (d0[HEADER:] + d1[HEADER:])[:len(shard)] == shard and not any((d0[HEADER:] + d1[HEADER:])[len(shard):])
    assert rep.fragment_bytes_sent == 3 * fb and rep.encode_cpu_s > 0
    # a holder's quota accounting counts its fragments (ls / doctor: the room the next round needs)
    assert job.servers["n1"][1].usage()["next_bytes"] == HEADER + fb
    assert 3 * fb <= 1.05 * 1.5 * len(shard)  # (k+m)/k of the state, plus padding to 4 KiB
    # rebuilt from the data fragments (n3, parity, gone), then with a data fragment's holder gone
    for gone in ("n3", "n1"):
        saved = job.fragment(gone, 1, {"n3": 2, "n1": 0}[gone])
        os.rename(saved, saved + ".away")
        tier, step = job.restore_into(str(tmp_path / f"new-{gone}"))
        os.rename(saved + ".away", saved)
        assert step == 1 and tier.steps() == [1]
        assert open(os.path.join(tier.step_dir(1), NAME), "rb").read() == shard
        assert not [f for f in os.listdir(tier.step_dir(1)) if f.startswith(".")]  # no scratch fragment left
    # the replaced node loads it as a local copy, every tensor checked
    back = {"w": torch.empty(200_000), "b": torch.empty(5001, dtype=torch.int64), "meta": {}}
    zerostall.load(str(tmp_path / "new-n1"), back, step=1)
    assert torch.equal(back["b"], torch.arange(5001))


def test_a_flipped_byte_in_a_fragment_is_caught_and_another_fragment_used(job, tmp_path):
    job.save(1)
    rep = job.replicator()
    assert len(job.send(rep, 1)[0]) == 3
    shard = open(os.path.join(job.src, "step-1", NAME), "rb").read()
    flip_byte(job.fragment("n1", 1, 0), HEADER + 5000)  # data fragment 0 rots on its holder
    tier, _ = job.restore_into(str(tmp_path / "new"))
    assert open(os.path.join(tier.step_dir(1), NAME), "rb").read() == shard  # decoded from 1 and 2
    flip_byte(job.fragment("n3", 1, 2), HEADER + 100)  # now only one good fragment of three
    with pytest.raises(CheckpointNotFound, match="1 of the 2 fragments"):
        job.restore_into(str(tmp_path / "new2"))
    assert LocalTier(str(tmp_path / "new2")).steps() == [] and not LocalTier(str(tmp_path / "new2")).partial_steps()


POINTS = ["frag-send:connect", "frag-send:handshake", "frag-send:mid-stream", "frag-send:sent",
          "frag-recv:mid-stream", "frag-recv:before-fsync", "frag-recv:before-rename", "frag-recv:before-ack"]


def test_a_transfer_cut_at_each_state_keeps_the_previous_step_and_never_counts_unacknowledged(job, tmp_path):
    job.save(1)
    rep = job.replicator()
    assert len(job.send(rep, 1)[0]) == 3
    before = {n: open(job.fragment(n, 1, i), "rb").read() for i, n in enumerate(NODES[1:])}
    for k, point in enumerate(POINTS):
        step = 2 + k
        job.save(step)

        def hook(p, point=point):
            if p == point:
                raise OSError(f"cut at {p}")
        stream.fault_hook = hook
        try:
            ok, failed = job.send(rep, step, {2: "n3"})  # the parity fragment, to n3
        finally:
            stream.fault_hook = None
        assert ok == {} and failed, point  # never acknowledged
        d = os.path.join(str(tmp_path / "n3"), "peers", "n0", f"step-{step}")
        final = [f for f in os.listdir(d) if f.startswith("fragment-")] if os.path.isdir(d) else []
        if point != "frag-recv:before-ack":
            assert final == [], point  # nothing under a final name before the rename
        job.servers["n3"][1].clean()  # what start-up does
        assert not [f for f in os.listdir(d) if f.startswith(".incoming")] if os.path.isdir(d) else True
        for i, n in enumerate(NODES[1:]):
            assert open(job.fragment(n, 1, i), "rb").read() == before[n], (point, n)
    # step 1 is still the newest step the holders can rebuild, bit-exact
    tier, step = job.restore_into(str(tmp_path / "new"))
    assert step == 1
    assert open(os.path.join(tier.step_dir(1), NAME), "rb").read() == \
        open(os.path.join(job.src, "step-1", NAME), "rb").read()


def test_a_holder_stopped_mid_fetch_is_replaced_by_the_next_fragment(job, tmp_path):
    job.save(1)
    rep = job.replicator()
    assert len(job.send(rep, 1)[0]) == 3
    shard = open(os.path.join(job.src, "step-1", NAME), "rb").read()
    job.servers["n1"][0].close()  # n1 (data fragment 0) serves from a child that stops mid-fetch
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the child
        try:
            def stop(p):  # the serving thread itself: os.kill lets it run on for a moment
                if p == "frag-serve:mid-stream":
                    signal.pthread_kill(threading.get_ident(), signal.SIGSTOP)
            stream.fault_hook = stop
            tier = LocalTier(str(tmp_path / "n1"))
            t = TcpTransport(SECRET, "n1", set(NODES), timeout_s=3, pacer=Pacer(None))
            ps = PeerStore(tier, "n1", lambda: choose_engine(tier.root))
            register(t, FragmentStore(ps), set(NODES), "n1", "normal", None)
            os.write(w, str(t.serve(ps)[1]).encode())
            time.sleep(120)
        finally:
            os._exit(0)
    try:
        os.close(w)
        port = int(os.read(r, 32))
        job.eps["n1"] = Endpoint("n1", "127.0.0.1", port)
        tier, step = job.restore_into(str(tmp_path / "new"))
        assert step == 1 and open(os.path.join(tier.step_dir(1), NAME), "rb").read() == shard
        _, status = os.waitpid(pid, os.WNOHANG | os.WUNTRACED)
        assert os.WIFSTOPPED(status)  # it really was stopped mid-fetch, and the restore went on
    finally:
        os.kill(pid, signal.SIGKILL)
        os.kill(pid, signal.SIGCONT)
        os.waitpid(pid, 0)
        os.close(r)


def _fork(fn):
    """Run ``fn()`` in a forked child; its pid. The child ends with ``os._exit``."""
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the child
        try:
            fn()
        finally:
            os._exit(0)
    return pid


def _kill_at(point):
    def hook(p):
        if p == point:  # this very thread: os.kill may let it run on for a moment
            signal.pthread_kill(threading.get_ident(), signal.SIGKILL)
    return hook


def test_sigkill_at_each_state_of_a_fragment_transfer_keeps_the_previous_step(job, tmp_path):
    """The sender (a forked child sending n0's parity fragment) or the holder (a forked child
    serving n3) SIGKILLed at each state: n3 keeps only whole fragments under final names after
    start-up cleaning, step 1 stays intact on every holder and rebuilds bit-exact."""
    job.save(1)
    rep = job.replicator()
    assert len(job.send(rep, 1)[0]) == 3
    before = {n: open(job.fragment(n, 1, i), "rb").read() for i, n in enumerate(NODES[1:])}
    parent_n3 = job.eps["n3"]
    n3 = LocalTier(str(tmp_path / "n3"))
    for k, point in enumerate(["frag-send:connect", "frag-send:handshake", "frag-send:mid-stream", "frag-send:sent",
                               "frag-recv:mid-stream", "frag-recv:before-fsync", "frag-recv:before-rename",
                               "frag-recv:before-ack"]):
        step = 2 + k
        job.save(step)
        if point.startswith("frag-send"):
            job.eps["n3"] = parent_n3
            pid = _fork(lambda: (setattr(stream, "fault_hook", _kill_at(point)), job.send(rep, step, {2: "n3"})))
            _, status = os.waitpid(pid, 0)
        else:
            job.servers["n3"][0].close()
            r, w = os.pipe()

            def holder():
                stream.fault_hook = _kill_at(point)
                t = TcpTransport(SECRET, "n3", set(NODES), timeout_s=3, pacer=Pacer(None))
                ps = PeerStore(n3, "n3", lambda: choose_engine(n3.root))
                register(t, FragmentStore(ps), set(NODES), "n3", "normal", None)
                os.write(w, str(t.serve(ps)[1]).encode())
                time.sleep(60)
            pid = _fork(holder)
            os.close(w)
            job.eps["n3"] = Endpoint("n3", "127.0.0.1", int(os.read(r, 32)))
            os.close(r)
            ok, failed = job.send(rep, step, {2: "n3"})
            assert ok == {} and failed, (point, ok)
            _, status = os.waitpid(pid, 0)
        assert os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGKILL, point
        PeerStore(n3, "n3", lambda: choose_engine(n3.root)).clean()  # what the next start does
        d = os.path.join(n3.root, "peers", "n0", f"step-{step}")
        left = sorted(os.listdir(d)) if os.path.isdir(d) else []
        assert not [f for f in left if f.startswith(".")], (point, left)
        if point != "frag-recv:before-ack":  # renamed only after fsync: a final name is a whole fragment
            assert "fragment-2" not in left, (point, left)
        for i, n in enumerate(NODES[1:]):
            assert open(job.fragment(n, 1, i), "rb").read() == before[n], (point, n)
    job.servers["n3"] = (TcpTransport(SECRET, "n3", set(NODES), timeout_s=3, pacer=Pacer(None)), None)
    ps = PeerStore(n3, "n3", lambda: choose_engine(n3.root))
    register(job.servers["n3"][0], FragmentStore(ps), set(NODES), "n3", "normal", None)
    job.eps["n3"] = Endpoint("n3", *job.servers["n3"][0].serve(ps))
    tier, step = job.restore_into(str(tmp_path / "new"))  # no later step has k fragments anywhere
    assert step == 1 and open(os.path.join(tier.step_dir(1), NAME), "rb").read() == \
        open(os.path.join(job.src, "step-1", NAME), "rb").read()


def test_an_incremental_step_is_rebuilt_with_the_step_it_references(job, tmp_path):
    """Each step codes only the bytes its own files hold; rebuilding an incremental step
    rebuilds the earlier step it borrows tensors from too, and the load is bit-exact."""
    frozen = torch.randn(300_000, generator=torch.Generator().manual_seed(7))
    with zerostall.Checkpointer(job.src, incremental=True) as ck:
        ck.save(1, {"frozen": frozen, "w": torch.zeros(1000)}).result()
        ck.save(2, {"frozen": frozen, "w": torch.ones(1000)}).result()
    src = LocalTier(job.src)
    assert {r.step for r in src.read_manifest(2).ref_files} == {1}  # step 2 borrows "frozen" from step 1
    assert os.path.getsize(os.path.join(job.src, "step-2", NAME)) < os.path.getsize(os.path.join(job.src, "step-1",
                                                                                                   NAME))
    rep = job.replicator()
    for step in (1, 2):
        assert len(job.send(rep, step)[0]) == 3
    tier, step = job.restore_into(str(tmp_path / "new"))
    assert step == 2 and tier.steps() == [1, 2]
    back = {"frozen": torch.empty(300_000), "w": torch.empty(1000)}
    zerostall.load(tier.root, back, step=2)
    assert torch.equal(back["frozen"], frozen) and torch.equal(back["w"], torch.ones(1000))
