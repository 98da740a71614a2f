"""Peer replicas end to end: 4 simulated nodes x 1 rank (real processes, gloo on 127.0.0.1,
ZEROSTALL_NODE=n0..n3, each node its own root), nodes killed and wiped, the job restarted."""

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from datetime import timedelta

import pytest

from zerostall.format.layout import HEADER_BYTES, shard_name
from zerostall.format.manifest import Manifest
from zerostall.peers.exchange import Node, holders
from zerostall.peers.tcp import Pacer, TcpTransport
from zerostall.peers.verify import StreamCheck
from zerostall.peers.wire import Endpoint, PeerError
from zerostall.store.local import LocalTier

from ..helpers import flip_byte, free_port

HERE = os.path.dirname(__file__)
NODES = [f"n{i}" for i in range(4)]


def _spawn(scenario, base, tmp_path, env_extra, nodes=NODES, worker="peers_worker.py"):
    """One process per entry of ``nodes`` (rank r runs on node ``nodes[r]``), each running
    ``worker``: ``[(Popen, its result file), ...]``."""
    port = free_port()
    procs = []
    for r, node in enumerate(nodes):
        local = nodes[:r].count(node)
        env = dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(r), WORLD_SIZE=str(len(nodes)),
                   LOCAL_RANK=str(local), LOCAL_WORLD_SIZE=str(nodes.count(node)), ZEROSTALL_NODE=node,
                   ZEROSTALL_BUDGET_BYTES=str(64 << 20),
                   PYTHONPATH=os.pathsep.join([os.path.dirname(HERE), HERE, os.environ.get("PYTHONPATH", "")]),
                   **env_extra)
        out = str(tmp_path / f"{scenario}-r{r}.json")
        if os.path.exists(out):
            os.unlink(out)
        procs.append((subprocess.Popen([sys.executable, os.path.join(HERE, worker), scenario, base, out],
                                       env=env, stderr=subprocess.PIPE, text=True), out))
    return procs


def _collect(procs, timeout):
    """Each process's ``(returncode, result document or None, stderr)``; any still running
    after ``timeout`` is continued (if stopped) and killed."""
    results = []
    try:
        for p, out in procs:
            _, err = p.communicate(timeout=timeout)
            results.append((p.returncode, json.load(open(out)) if os.path.exists(out) else None, err))
    finally:
        _kill_all(procs)
    return results


def _kill_all(procs):
    """Continue (if stopped) and kill every process of ``procs`` still running (by pid: ours)."""
    for p, _ in procs:
        if p.poll() is None:
            os.kill(p.pid, signal.SIGCONT)
            p.kill()
            p.wait()


def _launch(scenario, base, tmp_path, env_extra, timeout=150, stop=None, nodes=NODES, worker="peers_worker.py"):
    """One process per entry of ``nodes`` (rank r runs on node ``nodes[r]``), each running ``worker``."""
    procs = _spawn(scenario, base, tmp_path, env_extra, nodes, worker)
    try:
        if stop is not None:  # the stopped rank is SIGKILLed once the others have finished
            for p, _ in procs[:stop] + procs[stop + 1:]:
                p.wait(timeout=timeout)
            procs[stop][0].kill()
    except BaseException:
        _kill_all(procs)
        raise
    return _collect(procs, timeout)


def _ok(res):
    for rc, doc, err in res:
        assert rc == 0 and doc is not None, err[-3000:]
    return [doc for _, doc, _ in res]


def _wipe(base, node):
    shutil.rmtree(os.path.join(base, node))


def _holder_of(src, replicas):
    return holders(src, [Node(n, n) for n in NODES], replicas)


def test_n3_two_nodes_killed_and_wiped_restore_bit_exact_from_peers(tmp_path, capsys):
    base = str(tmp_path / "job")
    res = _launch("save", base, tmp_path, {"ZS_REPLICAS": "3", "ZS_DIE": "1"})
    assert res[1][0] == -signal.SIGKILL
    docs = [json.load(open(tmp_path / f"save-r{r}.json")) for r in range(len(NODES))]
    for d in docs:
        assert d["protected"] == {"1": True, "2": True}, d
        assert len(set(d["replica_nodes"]["2"])) == 3 and d["replica_nodes"]["2"][0] == d["node"]
        assert set(d["replica_nodes"]["2"][1:]) == set(_holder_of(d["node"], 3))
    for d in (0, 2, 3):
        assert res[d][0] == 0, res[d][2][-3000:]
    # every holder holds exactly what the placement says, in its own root only
    for n in NODES:
        held = sorted(d for d in os.listdir(os.path.join(base, n, "peers")) if not d.startswith("."))
        assert held == sorted(s for s in NODES if n in _holder_of(s, 3)), (n, held)
    # `zerostall ls` of a node's root: its steps' holders and protection, the copies it holds
    from zerostall.cli.app import main
    capsys.readouterr()
    assert main(["ls", "--json", os.path.join(base, "n0")]) == 0
    rows = json.loads(capsys.readouterr().out)
    own = {r["step"]: r for r in rows if r["tier"].startswith("local")}
    assert own[2]["protected"] is True and own[2]["holders"][0] == "n0"
    assert set(own[2]["holders"][1:]) == set(_holder_of("n0", 3))
    # each holder's use of its area for peers' copies (no quota here), as reported with step 2
    assert set(own[2]["holder_usage"]) == set(_holder_of("n0", 3))
    for h, u in own[2]["holder_usage"].items():
        assert u["quota_bytes"] is None and u["used_bytes"] > 0 and u["refused"] == 0, (h, u)
    assert {r["tier"] for r in rows if r["tier"].startswith("peer copy")} == {
        f"peer copy of {s}" for s in NODES if "n0" in _holder_of(s, 3)}
    # `zerostall doctor ROOT`: the newest step's protection; the peers do not answer (job ended)
    from zerostall.peers.status import doctor_checks
    rows = {r[0]: r for r in doctor_checks(os.path.join(base, "n0"), timeout_s=0.5)}
    assert rows["peer_replicas"][2] == "ok" and rows["peer_replicas"][1].startswith("step 2: held by n0")
    assert {k for k in rows if k.startswith("peer ")} == {f"peer {n}" for n in NODES}
    assert all(rows[f"peer {n}"][2] == "warn" for n in NODES)
    assert all(rows[f"peer_quota {n}"][2] == "ok" and "(no quota)" in rows[f"peer_quota {n}"][1] for n in NODES)
    _wipe(base, "n1")  # SIGKILLed above, its disk gone
    _wipe(base, "n2")
    docs = _ok(_launch("load", base, tmp_path, {"ZS_REPLICAS": "3"}))
    for d in docs:
        assert d.get("error") is None, d
        assert d["step"] == 2 and d["equal"] is True, d
    assert [d["source"] for d in docs] == ["local", "peers", "peers", "local"]
    for n in ("n1", "n2"):  # the replacement nodes hold step 2 again, committed and complete
        assert LocalTier(os.path.join(base, n)).steps() == [2]
    # repair: the replaced holders hold their sources' kept steps again (each node's start-up pass)
    assert all(d["repaired"] for d in docs)
    for n in ("n1", "n2"):
        for s in NODES:
            if n in _holder_of(s, 3) and s not in ("n1", "n2"):  # a wiped source has only step 2 now
                assert sorted(os.listdir(os.path.join(base, n, "peers", s))) == ["step-1", "step-2"], (n, s)


def test_n2_both_holders_of_a_file_lost_remote_fallback_or_none_everywhere(tmp_path):
    base, remote = str(tmp_path / "job"), str(tmp_path / "remote")
    env = {"ZS_REPLICAS": "2", "ZS_REMOTE": f"file://{remote}"}
    for d in _ok(_launch("save", base, tmp_path, env)):
        assert d["protected"] == {"1": True, "2": True}, d
    # a node and the one holder of its files are lost; that holder's own files live on elsewhere
    lost = next(n for n in NODES if _holder_of(_holder_of(n, 2)[0], 2)[0] != n)
    (h,) = _holder_of(lost, 2)
    _wipe(base, lost)
    _wipe(base, h)
    r = NODES.index(lost)
    # without the remote tier, no step can be loaded by the lost node's rank: every rank says so, alike
    docs = _ok(_launch("load", base, tmp_path, {"ZS_REPLICAS": "2"}))
    errors = {d.get("error") for d in docs}
    assert len(errors) == 1 and None not in errors, docs
    (msg,) = errors
    assert f"step 2: missing on rank(s) {r};" in msg and "remote tier" in msg
    assert all(d["error_type"] == "CheckpointNotFound" for d in docs)
    assert not os.path.exists(os.path.join(base, lost, "step-2"))
    # with it: the lost node's files come from the remote tier, the wiped holder's own from its peers
    docs = _ok(_launch("load", base, tmp_path, env))
    for d in docs:
        assert d.get("error") is None and d["step"] == 2 and d["equal"] is True, d
    src = {d["node"]: d["source"] for d in docs}
    assert src[lost] == "remote" and src[h] == "peers"
    assert all(v == "local" for k, v in src.items() if k not in (lost, h))


def test_a_stopped_peer_never_hangs_training_or_close(tmp_path):
    base = str(tmp_path / "job")
    res = _launch("stop", base, tmp_path, {"ZS_REPLICAS": "2", "ZS_STOP": "3", "ZS_RT": "12", "ZS_PT": "3"}, stop=3)
    assert res[3][0] == -signal.SIGKILL
    for rc, d, err in res[:3]:
        assert rc == 0 and d is not None, err[-3000:]
        assert d["trained"] == 20 and d["last_durable"] is True
        assert d["last_protected"] is False  # n3 never reported its copies: never presented as protected
        assert d["unprotected"] == [2]
        print(f"{d['node']}: 20 training steps in {d['train_s']:.2f} s, close() in {d['close_s']:.2f} s "
              "(close_timeout_s=4, peers.timeout_s=3)")
    # the nodes whose placement named n3 copied to the next node instead (unless n3 took the copy
    # just before it stopped): every node's step 2 is held by one other node
    for n in ("n0", "n1", "n2"):
        held_by = [m for m in NODES if m != n and os.path.isfile(os.path.join(base, m, "peers", n, "step-2",
                                                                              f"rank-0000{n[1]}.shard"))]
        assert held_by, res[NODES.index(n)][2][-3000:]


def test_two_ranks_per_node_wiped_node_restores_both_ranks_from_peers(tmp_path):
    nodes = ["n0", "n0", "n1", "n1"]  # the node's leader sends and fetches both ranks' files
    base = str(tmp_path / "job")
    for d in _ok(_launch("save", base, tmp_path, {"ZS_REPLICAS": "2"}, nodes=nodes)):
        assert d["protected"] == {"1": True, "2": True}, d
    assert sorted(os.listdir(os.path.join(base, "n0", "peers", "n1", "step-2"))) == [
        "manifest.json", "rank-00002.shard", "rank-00003.shard"]
    _wipe(base, "n1")
    docs = _ok(_launch("load", base, tmp_path, {"ZS_REPLICAS": "2"}, nodes=nodes))
    for d in docs:
        assert d.get("error") is None and d["step"] == 2 and d["equal"] is True, d
    assert [d["source"] for d in docs] == ["local", "local", "peers", "peers"]


# ---- commits: Peer copies tied to the commit they belong to (issue 32, items 2 and 3): 4 simulated nodes x
# 1 rank (real processes, gloo), replicas=2 (placement: n0's files on n2, n1's on n3, n2's and
# n3's on n0).


ENV = {"ZS_REPLICAS": "2"}


def _own_files_verify(base, node, rank, steps):
    """Every step of ``steps`` is committed in ``node``'s root with the node's own shard, and
    that shard verifies byte for byte against the step's manifest."""
    for step in steps:
        d = os.path.join(base, node, f"step-{step}")
        name = shard_name(rank)
        man = Manifest.from_bytes(open(os.path.join(d, "manifest.json"), "rb").read())
        path = os.path.join(d, name)
        assert os.path.isfile(path), (node, step, sorted(os.listdir(d)))
        check = StreamCheck(man, name, path)
        check.feed(memoryview(open(path, "rb").read()))
        check.digest()


def test_a_superseded_copy_is_never_restored_and_a_fetch_never_replaces_a_step(tmp_path):
    """Step 2 is saved, protected, then overwritten (other values) and protected again, but n0's
    holder (n2) keeps the superseded copy. n0 is wiped: the restart must not restore step 2
    from that copy (all ranks load one commit: step 1, from n2 for n0, bit-exact). Then the job
    restarts on 3 nodes (n1, n2, n3 as ranks 0-2: each fetches another node's shard into its own
    committed steps): every node's own files of steps 1 and 2 survive it and still verify."""
    base = str(tmp_path / "job")
    assert _holder_of("n0", 2) == ("n2",)
    docs = _ok(_launch("overwrite", base, tmp_path, ENV, worker="commits_worker.py"))
    assert [d["protected"] for d in docs] == [{"1": [True], "2": [True, True]}] * 4, docs
    assert [d.get("set_aside", False) for d in docs] == [False, False, True, False], docs
    shutil.rmtree(os.path.join(base, "n0"))
    docs = _ok(_launch("load", base, tmp_path, ENV, worker="commits_worker.py"))
    assert {d.get("step") for d in docs} == {1}, docs  # one commit for every rank
    assert all(d["equal"] is True for d in docs), docs
    assert docs[0]["source"] == "peers", docs[0]
    _launch("load", base, tmp_path, ENV, nodes=["n1", "n2", "n3"], worker="commits_worker.py")
    for r, node in enumerate(NODES[1:], start=1):
        _own_files_verify(base, node, r, (1, 2))


# ---- fallback: A peer restore that fails on one rank is heard by every rank, and all fall back together
# (issue 32, items 5, 6 and 15): 2 simulated nodes x 1 rank (real processes, gloo on 127.0.0.1),
# node-local roots, ``replicas=2``, the c10d store hosted by this test (as torchrun's agent).
#
# The save job runs with the peer secret given by the launcher (``ZEROSTALL_PEER_SECRET``):
# while it runs, every key of the store is listed and read, and none holds the secret -- every
# value, tried as a secret, is refused by both nodes' peer servers.
#
# Then n0 is wiped and the job restarts. n1, n0's one live holder, stops (SIGSTOP) as it starts
# serving n0's step 4, and is continued only once n0's fetch timed out on it; it serves a
# flipped byte in its copy of n0's step 3; n1's own step 2 is damaged. No rank may raise alone
# while the other waits out its timeout: step 4 fails on n0 (the stopped holder), step 3 fails on
# n0 (the flipped byte), every rank hears each and drops it; step 2 is fetched by n0 but fails
# on n1 (its crc), every rank drops it; step 1 -- which n0 must still offer from its holder,
# though it fetched step 2 meanwhile -- loads bit-exact on both.


fb_HERE = os.path.dirname(__file__)
fb_NODES = ["n0", "n1"]
SECRET = "correct-horse-battery-staple-0123456789"


def _fbspawn(scenario, base, tmp_path, port, env_extra):
    """One process per node; each one's stderr goes to ``<its result file>.err``."""
    procs = []
    for r, node in enumerate(fb_NODES):
        env = dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(r), WORLD_SIZE="2",
                   LOCAL_RANK="0", LOCAL_WORLD_SIZE="1", ZEROSTALL_NODE=node, TORCHELASTIC_USE_AGENT_STORE="True",
                   ZEROSTALL_BUDGET_BYTES=str(64 << 20),
                   PYTHONPATH=os.pathsep.join([os.path.dirname(fb_HERE), fb_HERE,
                                               os.environ.get("PYTHONPATH", "")]), **env_extra)
        out = str(tmp_path / f"{scenario}-r{r}.json")
        procs.append((subprocess.Popen([sys.executable, os.path.join(fb_HERE, "fallback_worker.py"), scenario, base, out],
                                       env=env, stderr=open(out + ".err", "w")), out))
    return procs


def _finish(procs, timeout=240):
    docs = []
    try:
        for p, out in procs:
            p.wait(timeout=timeout)
            assert p.returncode == 0 and os.path.exists(out), open(out + ".err").read()[-4000:]
            docs.append(json.load(open(out)))
    finally:
        _kill(procs)
    return docs


def _kill(procs):
    for p, _ in procs:  # by pid: the processes this test started
        if p.poll() is None:
            os.kill(p.pid, signal.SIGCONT)
            p.kill()
            p.wait()


def _wait(paths, procs, timeout=240):
    deadline = time.monotonic() + timeout
    while not all(os.path.exists(p) for p in paths):
        assert time.monotonic() < deadline and all(p.poll() is None for p, _ in procs), \
            [open(out + ".err").read()[-3000:] for p, out in procs if p.poll() is not None]
        time.sleep(0.05)


def _store_values(master):
    out = {}
    master.set_timeout(timedelta(seconds=2))  # a key deleted since the listing: get() would wait for it
    for k in master.list_keys():
        try:
            out[k] = master.get(k)
        except Exception:  # noqa: BLE001 - deleted meanwhile
            pass
    return out


def _as_secrets(v):
    """A store value as an attacker would try it: raw, and hex-decoded when it is hex."""
    out = [v]
    try:
        out.append(bytes.fromhex(v.decode()))
    except ValueError:
        pass
    return out


def _authenticates(secret, ep):
    t = TcpTransport(secret, "n0", set(fb_NODES), timeout_s=5, pacer=Pacer(None))
    try:
        t.list_held(ep)
        return True
    except PeerError:
        return False
    finally:
        t.close()


def test_a_failed_peer_restore_falls_back_together_and_the_secret_stays_out_of_the_store(tmp_path, monkeypatch):
    from torch.distributed import TCPStore
    base = str(tmp_path / "job")
    port = free_port()
    master = TCPStore("127.0.0.1", port, world_size=None, is_master=True, wait_for_workers=False,
                      timeout=timedelta(seconds=300))
    go = str(tmp_path / "go")
    procs = _fbspawn("save", base, tmp_path, port, {"ZS_STEPS": "1,2,3,4", "ZS_GO": go, "ZS_PT": "15",
                                                   "ZEROSTALL_PEER_SECRET": SECRET})
    try:
        _wait([out + ".ready" for _, out in procs], procs)
        ready = [json.load(open(out + ".ready")) for _, out in procs]
        eps = [Endpoint(d["node"], d["endpoint"].rsplit(":", 1)[0], int(d["endpoint"].rsplit(":", 1)[1]))
               for d in ready]
        assert all(d["protected"] == {"1": True, "2": True, "3": True, "4": True} for d in ready), ready  # the secret works
        # an attacker who reaches MASTER_PORT: every key, every value, each tried as the secret
        values = _store_values(master)
        assert values and not any(SECRET.encode() in v for v in values.values()), sorted(values)
        got_in = [k for k, v in values.items() if any(_authenticates(t, ep) for t in _as_secrets(v) for ep in eps)]
        assert got_in == [], got_in  # nothing read there gets in
    finally:
        open(go, "w").close()
    _finish(procs)
    # n0 lost; its one live holder serves a flipped byte of n0's step 3; n1's own step 2 rots
    import shutil
    shutil.rmtree(os.path.join(base, "n0"))
    flip_byte(os.path.join(base, "n1", "peers", "n0", "step-3", "rank-00000.shard"), HEADER_BYTES + 8)
    flip_byte(os.path.join(base, "n1", "step-2", "rank-00001.shard"), HEADER_BYTES + 8)
    port = free_port()
    master = TCPStore("127.0.0.1", port, world_size=None, is_master=True, wait_for_workers=False,
                      timeout=timedelta(seconds=300))
    procs = _fbspawn("load", base, tmp_path, port, {"ZEROSTALL_PEER_SECRET": SECRET, "ZS_PT": "2",
                                                  "ZS_STOP_SERVE": "n1"})
    try:
        (p1, out1), (_, out0) = procs[1], procs[0]
        _wait([out1 + ".stopped"], procs[:1])
        while _proc_state(p1.pid) not in ("T", "t"):
            time.sleep(0.02)
        # n0's fetch of step 4 times out on the stopped holder; n0 posts the failure and waits for n1
        deadline = time.monotonic() + 120
        while "fetching rank-00000.shard from node n1 failed" not in open(out0 + ".err").read():
            assert time.monotonic() < deadline and procs[0][0].poll() is None, open(out0 + ".err").read()[-3000:]
            time.sleep(0.05)
        assert _proc_state(p1.pid) in ("T", "t")
        os.kill(p1.pid, signal.SIGCONT)
        loaded = _finish(procs)
    finally:
        _kill(procs)
    for d in loaded:
        assert d.get("error") is None, d
        assert d["step"] == 1 and d["equal"] is True, d
        for part in ("step 4 failed on rank 0", "step 3 failed on rank 0", "step 2 failed on rank 1"):
            assert part in d["why"], (part, d["why"])
    assert [d["source"] for d in loaded] == ["peers", "local"]
    del master


def _proc_state(pid):
    with open(f"/proc/{pid}/stat") as f:
        return f.read().rsplit(")", 1)[1].split()[0]
