"""Adversarial checks of peer replicas (adv1): 2 simulated nodes x 1 rank on gloo (real
processes, each node its own root), the harness of test_peers.py."""

import json
import os
import shutil
import signal

import pytest

from tests.helpers import flip_byte

from zerostall.store.local import LocalTier

from .test_peers import _launch, _ok


def test_flipped_byte_in_one_nodes_newest_local_shard_still_loads(tmp_path):
    """n1's own rank-00001.shard of step 2 gets a flipped payload byte (same size, so it still
    looks complete); an intact copy is held by its peer. load() must restore on every rank:
    step 2 (from the peer copy) or step 1 everywhere -- never fail the whole job."""
    base = str(tmp_path / "job")
    nodes = ["n0", "n1"]
    for d in _ok(_launch("save", base, tmp_path, {"ZS_REPLICAS": "2"}, nodes=nodes)):
        assert d["protected"] == {"1": True, "2": True}, d
    flip_byte(os.path.join(base, "n1", "step-2", "rank-00001.shard"), 8192)
    docs = _ok(_launch("load", base, tmp_path, {"ZS_REPLICAS": "2"}, nodes=nodes))
    for d in docs:
        assert d.get("error") is None, d
        assert d["equal"] is True, d
    assert len({d["step"] for d in docs}) == 1, docs


def test_wiped_node_restores_an_incremental_step_from_peers(tmp_path):
    """incremental="crc", replicas=2, 2 nodes: step 2 references step 1's bytes of the frozen
    tensor. n1 is wiped; its restart must restore step 2 bit-exact (the referenced step's files
    are held by n0 too: "referenced bytes travel with their own step")."""
    base = str(tmp_path / "job")
    env = {"ZS_REPLICAS": "2", "ZS_KW": json.dumps({"incremental": "crc"})}
    nodes = ["n0", "n1"]
    for d in _ok(_launch("save", base, tmp_path, env, nodes=nodes, worker="adv_worker.py")):
        assert d["protected"] == {"1": True, "2": True}, d
    man = LocalTier(os.path.join(base, "n1")).read_manifest(2)
    assert man.ref_files, "step 2 is not incremental: the test does not test what it says"
    shutil.rmtree(os.path.join(base, "n1"))
    docs = _ok(_launch("load", base, tmp_path, env, nodes=nodes, worker="adv_worker.py"))
    for d in docs:
        assert d.get("error") is None, d
        assert d["step"] == 2 and d["equal"] is True, d


def test_keep_last_never_leaves_the_newest_protected_step_with_one_copy(tmp_path):
    """keep_last=1, replicas=2, 2 nodes. Step 1 is protected (each node's files on both nodes).
    Step 2 commits everywhere; n1 dies as it starts copying step 2 (its files of step 2 exist
    nowhere else). Local retention must not have deleted n0's own step-1 files meanwhile: they
    were one of step 1's two copies, and the other is on the dead n1. After n1 is replaced
    (wiped), the job must restore step 1 -- the step that was reported protected -- on both."""
    base = str(tmp_path / "job")
    env = {"ZS_REPLICAS": "2", "ZS_KW": json.dumps({"keep_last": 1}), "ZS_RT": "5"}
    nodes = ["n0", "n1"]
    res = _launch("save", base, tmp_path, dict(env, ZS_KILL_RANK="1", ZS_KILL_STEP="2"), nodes=nodes,
                  worker="adv_worker.py")
    assert res[1][0] == -signal.SIGKILL, res[1][2][-3000:]
    assert res[0][0] == 0, res[0][2][-3000:]
    assert res[0][1]["protected"] == {"1": True, "2": False}, res[0][1]
    shutil.rmtree(os.path.join(base, "n1"))
    docs = _ok(_launch("load", base, tmp_path, env, nodes=nodes, worker="adv_worker.py"))
    for d in docs:
        assert d.get("error") is None, d
        assert d["step"] == 1 and d["equal"] is True, d
