"""Coded copies beyond what the code survives: 4 simulated nodes x 1 rank (real processes, gloo
on 127.0.0.1), RS(2,1), every step also on a shared-filesystem remote tier. The owner n0 and
two of its three holders (n1, n2) are wiped: one fragment of n0's files is left, fewer than
k = 2, and so for n1's and n2's files. Without the remote tier every rank raises the same
CheckpointNotFound; with it every rank loads the same step, bit-exact: the wiped nodes from
the remote tier, n3 from its own root. One launch: each process saves, closes, wipes its root
(n0..n2) and restarts the job twice (Checkpointers one after the other): process start-up is
most of such a test's time."""

from .test_coded_nodes import WORKER, _docs
from .test_peers import _launch

NODES = ["n0", "n1", "n2", "n3"]


def test_owner_plus_m_plus_1_holders_lost_falls_back_to_the_remote_tier_or_fails_alike(tmp_path):
    base, remote = str(tmp_path / "job"), f"file://{tmp_path / 'remote'}"
    env = {"ZS_K": "2", "ZS_M": "1", "ZS_REMOTE": remote}
    docs = _docs(_launch("fallback", base, tmp_path, {**env, "ZS_WIPE": "n0,n1,n2"}, nodes=NODES, worker=WORKER,
                         timeout=180))
    for d in docs:
        assert d["protected"] == {"1": True, "2": True} and d["durable"] == {"1": True, "2": True}, d
        assert sorted(d["replica_nodes"]["2"]) == NODES, d  # each node's 3 fragments on the 3 others
    without = [d["without"] for d in docs]
    assert {d.get("error_type") for d in without} == {"CheckpointNotFound"}, without
    assert len({d["error"] for d in without}) == 1, [d["error"] for d in without]
    assert "remote tier" in without[0]["error"], without[0]["error"]
    for d in docs:
        got = d["with"]
        assert got.get("error") is None and got["step"] == 2 and got["equal"] is True, d
        assert got["source"] == ("local" if d["node"] == "n3" else "remote"), d
