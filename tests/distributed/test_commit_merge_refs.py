"""The per-rank merge of incremental fragments (dist/commit.py): every rank's references end up
in one manifest, and what each rank's base may still borrow reaches rank 0's retention."""

import pytest
import torch

from zerostall.distributed.commit import merge, peer_protected
from zerostall.format.manifest import Manifest
from zerostall.format.tree import encode_tree

from .test_dist_trust import run


def _frag(rank, refs, protect):
    name = f"rank-{rank:05d}.shard"
    own = {"key": "w", "dtype": "float32", "shape": [4], "file": name, "offset": 4096, "nbytes": 16, "crc32c": 1}
    borrowed = {"key": "frozen", "dtype": "float32", "shape": [8], "file": name, "offset": 4096, "nbytes": 32,
                "crc32c": 2, "step": 3}
    tensors = [[0, own]] + ([[1, borrowed]] if refs else [])
    tree, _ = encode_tree({"w": torch.zeros(4), **({"frozen": torch.zeros(8)} if refs else {})})
    frag = {"file": {"name": name, "rank": rank, "host": "h", "file_bytes": 8192, "file_id": f"id{rank}"},
            "tensors": tensors, "tree": tree, "n_tensors": len(tensors), "protect": protect}
    if refs:
        frag["ref_files"] = [{"step": 3, "name": name, "rank": rank, "file_bytes": 12288, "file_id": f"old{rank}"}]
    return frag


def test_merge_carries_every_ranks_references_and_round_trips():
    frags = [_frag(0, True, [3, 5]), _frag(1, False, [5]), _frag(2, True, [3, 4])]
    man = merge(frags, step=6, world=3, per_rank=True, user_metadata={})
    assert {(r.step, r.name, r.rank) for r in man.ref_files} == {(3, "rank-00000.shard", 0), (3, "rank-00002.shard", 2)}
    back = Manifest.from_bytes(man.to_bytes())
    assert back.format_version == 3 and back.ref_files == man.ref_files
    assert [e.step for e in back.tensors] == [None, 3, None, None, 3]
    assert peer_protected(frags) == {3, 4, 5}


def test_merge_without_references_has_no_ref_files():
    man = merge([_frag(0, False, []), _frag(1, False, [])], step=2, world=2, per_rank=True, user_metadata={})
    back = Manifest.from_bytes(man.to_bytes())
    assert man.ref_files == () and back.format_version == 3 and back.ref_files == ()
    assert "ref_files" not in man.body()
    assert peer_protected([{"file": {}}, {}]) == set()  # fragments of a non-incremental save


# ---- commit_decision: A committed decision survives the death of any one rank (issue 32, item 1): 2 simulated nodes
# (real processes, gloo, node-local roots, per-rank shards), rank 0 -- the coordinator -- SIGKILLed
# (by pid, at the commit round's ``fault_hook`` seam) after the decision of step 2, then the job
# restarted: every rank loads one step, and every rank whose handle said step 2 was durable loads
# step 2, bit-exact (its crc verified, its values those saved at step 2).


@pytest.mark.parametrize("point,agent", [("decided", True), ("recorded", False)],
                         ids=["before-its-record-launcher-store", "before-its-rename-rank0-store"])
def test_coordinator_killed_after_the_decision(tmp_path, point, agent):
    """decided: killed before its copy recorded the decision (the store hosted by the launcher,
    as torchrun does): rank 1 is never told durable, and all load step 1. recorded: killed
    between every copy's record and its own rename (the store hosted by rank 0, dying with it):
    the restart completes rank 0's copy and every rank loads step 2."""
    res, roots = run(tmp_path / "save", 2, agent=agent, scenario="steps", steps=[1, 2], timeout=3, no_barrier=True,
                     pause={"0": [[point, 2]]}, signals=[(0, 2, "kill")])
    rc, doc, err = res[1]
    assert rc == 0 and doc["1"]["state"] == "durable", err[-3000:]
    told = doc["2"]["state"]
    res, _ = run(tmp_path / "load", 2, roots=roots, agent=agent, scenario="load")
    loaded = set()
    for r, (rc, doc, err) in enumerate(res):
        assert rc == 0, err[-3000:]
        assert doc["loaded"] == doc["lib_loaded"] and doc["x0"] == 10.0 * doc["loaded"] + r, doc
        loaded.add(doc["loaded"])
    assert len(loaded) == 1, res  # one step for every rank
    if told == "durable":
        assert loaded == {2}, f"rank 1 was told step 2 is durable, the restart loaded {loaded}"
    assert loaded == ({1} if point == "decided" else {2}), (told, loaded)
