"""Peer copies tied to the commit they belong to (issue 32, items 2 and 3): 4 simulated nodes x
1 rank (real processes, gloo), replicas=2 (placement: n0's files on n2, n1's on n3, n2's and
n3's on n0)."""

import os
import shutil

from zerostall.format.layout import shard_name
from zerostall.format.manifest import Manifest
from zerostall.peers.verify import StreamCheck

from .test_peers import NODES, _holder_of, _launch, _ok

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
