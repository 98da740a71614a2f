"""The commit round of many ranks through one real c10d TCPStore across namespaces, CI-sized
(:mod:`.store_round`; the 512-rank run is its command line): 4 nodes x 16 ranks, the store
in n0's namespace on its 10.x address, every rank the library's start-up round and commit
strategy over the bridge.

Step 1 commits on every rank, every node's copy holds one manifest of all 64 files; in step 2
n2's link goes down after its ranks entered the round: every rank's handle fails before the
heal (the others with one abort decision naming n2's ranks, n2's own ``OutcomeUnknown``), no
node commits step 2; after the heal step 3 commits everywhere."""

import pytest

from .harness import unavailable
from .store_round import run


def test_64_ranks_on_4_nodes_commit_through_one_store_a_cut_node_fails_the_round_everywhere(tmp_path):
    why = unavailable()
    if why:
        pytest.skip(why)

    res = run(4, 16, str(tmp_path), timeout=60.0, fault=True, fault_timeout=2.0)
    assert res["problems"] == [], res
    assert res["step1"]["outcomes"] == {"durable": 64} and res["step3"]["outcomes"] == {"durable": 64}
    assert res["step2"]["outcomes"] == {"failed": 48, "unknown": 16}
    assert res["fault"]["cut_node"] == "n2" and "rank(s) 32, 33" in res["fault"]["decision"]
    assert res["step1"]["on_disk"] == "4 copies, checkpoint id ['store-round-1'], 64 files each"
    assert res["step2"]["on_disk"] == "step-2 committed on 0 of 4 nodes"
