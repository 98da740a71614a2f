"""A committed decision survives the death of any one rank (issue 32, item 1): 2 simulated nodes
(real processes, gloo, node-local roots, per-rank shards), rank 0 -- the coordinator -- SIGKILLed
(by pid, at the commit round's ``fault_hook`` seam) after the decision of step 2, then the job
restarted: every rank loads one step, and every rank whose handle said step 2 was durable loads
step 2, bit-exact (its crc verified, its values those saved at step 2)."""

import pytest

from .test_dist_trust import run


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
