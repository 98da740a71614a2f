"""Coded copies end to end: 7 simulated nodes x 1 rank (real processes, gloo on 127.0.0.1,
ZEROSTALL_NODE=n0..n6, each node its own root), RS(4,2): every node's files of a step as 4
data + 2 parity fragments on the 6 other nodes. One save, then two restarts:

* the owner plus 2 holders lost (n1 SIGKILLed, n1..n3 wiped): every wiped node rebuilds its
  files bit-exact from the 4 fragments left, every rank loads the same step, and the fragments
  the wiped holders lost are recomputed onto them (repair);
* the owner plus 3 holders lost (n1..n4 wiped): every rank raises the same CheckpointNotFound.

And a job of 3 nodes with RS(2,1) (4 nodes needed): every rank refuses to start, naming the numbers.
"""

import json
import os
import shutil
import signal

from zerostall.store.local import LocalTier

from .test_peers import _launch

HERE = os.path.dirname(__file__)
WORKER = os.path.join(HERE, "coded_worker.py")
NODES = [f"n{i}" for i in range(7)]
ENV = {"ZS_K": "4", "ZS_M": "2"}


def _docs(res):
    for rc, doc, err in res:
        assert rc == 0 and doc is not None, err[-3000:]
    return [doc for _, doc, _ in res]


def _fragments(base, holder):
    """{(src, step): [fragment names]} held by ``holder``."""
    out = {}
    area = os.path.join(base, holder, "peers")
    for src in os.listdir(area) if os.path.isdir(area) else []:
        if src.startswith(".") or not os.path.isdir(os.path.join(area, src)):
            continue
        for sd in os.listdir(os.path.join(area, src)):
            names = sorted(f for f in os.listdir(os.path.join(area, src, sd)) if f.startswith("fragment-"))
            if names:
                out[(src, int(sd[5:]))] = names
    return out


def test_rs42_owner_plus_m_lost_rebuilds_bit_exact_and_one_more_fails_alike(tmp_path, capsys):
    base = str(tmp_path / "job")
    res = _launch("save", base, tmp_path, {**ENV, "ZS_DIE": "1"}, nodes=NODES, worker=WORKER, timeout=180)
    assert res[1][0] == -signal.SIGKILL
    docs = [json.load(open(tmp_path / f"save-r{r}.json")) for r in range(len(NODES))]
    for d in docs:
        assert d["protected"] == {"1": True, "2": True}, d
        assert d["replica_nodes"]["2"][0] == d["node"] and sorted(d["replica_nodes"]["2"]) == NODES, d
    # each node's files of each step: one fragment on every other node, indices 0..5 once each
    for src in NODES:
        for step in (1, 2):
            got = sorted(f for h in NODES for f in _fragments(base, h).get((src, step), []))
            assert got == [f"fragment-{i}" for i in range(6)], (src, step)
            assert not _fragments(base, src).get((src, step))
    # bytes moved per save: (k + m) / k of the state, within 5% (padding, headers)
    for d in docs:
        shard = os.path.getsize(os.path.join(base, d["node"], "step-2", f"rank-{d['rank']:05d}.shard"))
        assert 6 / 4 * 2 * shard <= d["fragment_bytes_sent"] <= 1.05 * 6 / 4 * 2 * shard, d
        assert d["encode_cpu_s"] > 0
    # `zerostall ls` / `doctor` of a node's root: fragments held per step, whether it can be rebuilt
    from zerostall.cli.app import main
    from zerostall.peers.status import doctor_checks
    capsys.readouterr()
    assert main(["ls", "--json", os.path.join(base, "n0")]) == 0
    rows = json.loads(capsys.readouterr().out)
    own = {r["step"]: r for r in rows if r["tier"].startswith("local")}
    assert sorted(own[2]["fragments"].values()) == list(range(6)) and own[2]["rebuildable"] is True, own[2]
    assert own[2]["tier"].startswith("local+RS(4,2) fragments 6/6 on ") and own[2]["tier"].endswith(" protected")
    held = [r for r in rows if r["tier"] == "peer copy of n4"]
    assert [r["step"] for r in held] == [1, 2] and all("fragment-" in r["state"] for r in held), held
    frag_rows = [r for r in doctor_checks(os.path.join(base, "n0"), 0.2) if r[0] == "peer_fragments"]
    assert frag_rows[0][1].startswith("step 2: RS(4,2), 6 of 6 fragments held") and frag_rows[0][2] == "ok"
    for n in ("n1", "n2", "n3"):
        shutil.rmtree(os.path.join(base, n))
    docs = _docs(_launch("load", base, tmp_path, ENV, nodes=NODES, worker=WORKER, timeout=180))
    for d in docs:
        assert d.get("error") is None and d["step"] == 2 and d["equal"] is True, d
        assert d["source"] == ("coded" if d["node"] in ("n1", "n2", "n3") else "local"), d
        assert d["repaired"] is True
    for n in ("n1", "n2", "n3"):
        assert LocalTier(os.path.join(base, n)).steps() == [2]
    # repair: the wiped holders hold the surviving nodes' fragments of both steps again
    for src in ("n0", "n4", "n5", "n6"):
        for step in (1, 2):
            got = sorted(f for h in NODES for f in _fragments(base, h).get((src, step), []))
            assert got == [f"fragment-{i}" for i in range(6)], (src, step)
    for n in ("n1", "n2", "n3", "n4"):
        shutil.rmtree(os.path.join(base, n))
    docs = _docs(_launch("load", base, tmp_path, ENV, nodes=NODES, worker=WORKER, timeout=180))
    assert {d.get("error_type") for d in docs} == {"CheckpointNotFound"}, docs
    assert len({d["error"] for d in docs}) == 1, [d["error"] for d in docs]


def test_a_cluster_smaller_than_k_plus_m_plus_1_is_refused_at_start_up_on_every_rank(tmp_path):
    docs = _docs(_launch("load", str(tmp_path / "job"), tmp_path, {"ZS_K": "2", "ZS_M": "1"}, nodes=NODES[:3],
                         worker=WORKER, timeout=120))
    for d in docs:
        assert d["error_type"] == "ConfigError", d
        assert "needs at least 4 nodes; this job has 3 (n0, n1, n2)" in d["error"], d
        assert "at most 2, or use replicas=N" in d["error"], d


# ---- coded_fallback: Coded copies beyond what the code survives: 4 simulated nodes x 1 rank (real processes, gloo
# on 127.0.0.1), RS(2,1), every step also on a shared-filesystem remote tier. The owner n0 and
# two of its three holders (n1, n2) are wiped: one fragment of n0's files is left, fewer than
# k = 2, and so for n1's and n2's files. Without the remote tier every rank raises the same
# CheckpointNotFound; with it every rank loads the same step, bit-exact: the wiped nodes from
# the remote tier, n3 from its own root. One launch: each process saves, closes, wipes its root
# (n0..n2) and restarts the job twice (Checkpointers one after the other): process start-up is
# most of such a test's time.


cfb_NODES = ["n0", "n1", "n2", "n3"]


def test_owner_plus_m_plus_1_holders_lost_falls_back_to_the_remote_tier_or_fails_alike(tmp_path):
    base, remote = str(tmp_path / "job"), f"file://{tmp_path / 'remote'}"
    env = {"ZS_K": "2", "ZS_M": "1", "ZS_REMOTE": remote}
    docs = _docs(_launch("fallback", base, tmp_path, {**env, "ZS_WIPE": "n0,n1,n2"}, nodes=cfb_NODES, worker=WORKER,
                         timeout=180))
    for d in docs:
        assert d["protected"] == {"1": True, "2": True} and d["durable"] == {"1": True, "2": True}, d
        assert sorted(d["replica_nodes"]["2"]) == cfb_NODES, d  # each node's 3 fragments on the 3 others
    without = [d["without"] for d in docs]
    assert {d.get("error_type") for d in without} == {"CheckpointNotFound"}, without
    assert len({d["error"] for d in without}) == 1, [d["error"] for d in without]
    assert "remote tier" in without[0]["error"], without[0]["error"]
    for d in docs:
        got = d["with"]
        assert got.get("error") is None and got["step"] == 2 and got["equal"] is True, d
        assert got["source"] == ("local" if d["node"] == "n3" else "remote"), d
