"""Adversarial checks of coded copies (adv): the one-process harness of test_fragments.py
(node n0's root, holder servers n1..n3 on real sockets)."""

import dataclasses
import os

import torch

import zerostall
from zerostall.io.base import choose_engine
from zerostall.peers import tombstones
from zerostall.peers.coded import CodedReplicator
from zerostall.peers.coded_restore import holdings, rebuild
from zerostall.store.local import LocalTier

from .test_fragments import NAME, NODES, Job


def _state(seed):
    g = torch.Generator().manual_seed(seed)
    return {"w": torch.randn(50_000, generator=g), "meta": {"seed": seed}}


def _superseded(job):
    """RS(1,2): step 1 as commit A on n1, n2, n3, then overwritten (commit B) with only n3
    taking B's fragment: ``(replicator, A's checkpoint id, B's)``."""
    rep = CodedReplicator(LocalTier(job.src), job.view(), job.client, None, None, replicas=1, keep_last=None,
                          replica_timeout_s=30, data_fragments=1, parity_fragments=2)
    zerostall.save(job.src, _state(1), 1)
    assert len(job.send(rep, 1)[0]) == 3
    cid_a = LocalTier(job.src).read_manifest(1).checkpoint_id
    zerostall.save(job.src, _state(2), 1, overwrite=True)
    assert job.send(rep, 1, {2: "n3"})[0] == {2: "n3"}
    return rep, cid_a, LocalTier(job.src).read_manifest(1).checkpoint_id


def _steps_1_and_2_coded(job):
    """Steps 1 and 2 saved, each coded onto the three holders; the replicator."""
    rep = job.replicator()
    for step in (1, 2):
        job.save(step)
        assert len(job.send(rep, step)[0]) == 3
    return rep


def test_a_superseded_coding_of_the_step_is_never_rebuilt_as_the_commit_asked_for(tmp_path):
    """RS(1,2): commit A of step 1 coded onto n1, n2, n3; the owner overwrites step 1 (commit
    B, same sizes) and only n3 takes B's fragment before the owner is lost. Live holders then
    keep two fragments of A and one of B, each enough to rebuild. The ranks agreed on commit B
    (every other node's local step 1): the rebuild must give B's bytes, never the superseded
    A's (which passes every crc check, being a whole older commit)."""
    job = Job(tmp_path)
    try:
        rep, cid_a, cid_b = _superseded(job)
        shard_b = open(os.path.join(job.src, "step-1", NAME), "rb").read()
        assert cid_a != cid_b

        coded = holdings(job.view(), job.client)
        assert set(coded[1]) == {cid_a, cid_b}  # every commit live holders can rebuild, by checkpoint id
        root = str(tmp_path / "new")
        tier = LocalTier(root, create=True)
        rebuild(job.view(), job.client, tier, lambda: choose_engine(root), 1, coded, checkpoint_id=cid_b)
        assert tier.read_manifest(1).checkpoint_id == cid_b
        assert open(os.path.join(tier.step_dir(1), NAME), "rb").read() == shard_b
    finally:
        job.close()


def test_fragments_of_a_step_deleted_for_good_are_not_counted(tmp_path):
    """`zerostall delete` recorded a tombstone for step 2 (a holder was down and still keeps
    its fragments): a restore must not count them, as it does not count such full copies."""
    job = Job(tmp_path)
    try:
        _steps_1_and_2_coded(job)
        cid = LocalTier(job.src).read_manifest(2).checkpoint_id
        view = dataclasses.replace(job.view(), deleted={2: {"ids": [cid], "before": 0.0}})
        assert sorted(holdings(view, job.client)) == [1]
        created = LocalTier(job.src).read_manifest(2).created_unix
        view = dataclasses.replace(job.view(), deleted={2: {"ids": [], "before": created + 1}})
        assert sorted(holdings(view, job.client)) == [1]
    finally:
        job.close()


def test_the_repair_never_brings_back_the_fragments_of_a_step_deleted_for_good(tmp_path):
    """`zerostall delete` removed step 2 for good while n0 was down: the holders dropped their
    fragments of it (start-up, :func:`tombstones.drop_dead`), n0 still has its files. n0's
    start-up repair must give n2 back its lost fragment of step 1, and nobody any fragment of
    step 2 (as the replica repair never copies a deleted step again)."""
    job = Job(tmp_path)
    try:
        rep = _steps_1_and_2_coded(job)
        tombs = {2: {"ids": [LocalTier(job.src).read_manifest(2).checkpoint_id], "before": 0.0}}
        for n in NODES[1:]:
            assert tombstones.drop_dead(str(tmp_path / n), tombs) == [("n0", 2)]
        os.unlink(job.fragment("n2", 1, 1))
        rep.view = dataclasses.replace(job.view(), deleted=tombs)
        rep._repair()
        assert os.path.exists(job.fragment("n2", 1, 1))
        assert not [n for n in NODES[1:] if os.path.exists(os.path.join(str(tmp_path / n), "peers", "n0", "step-2"))]
    finally:
        job.close()


def test_the_repair_counts_only_fragments_of_the_commit_it_holds_and_replaces_the_others(tmp_path):
    """Step 1 coded as commit A onto n1..n3, then overwritten (commit B) with only n3 taking
    B's fragment: the repair counts n1's and n2's fragments of A for nothing and recomputes B's
    there, so live holders keep B whole and nothing of A."""
    job = Job(tmp_path)
    try:
        rep, _, cid_b = _superseded(job)
        rep._repair()
        coded = holdings(job.view(), job.client)
        assert list(coded[1]) == [cid_b] and sorted(coded[1][cid_b].holders) == [0, 1, 2]
    finally:
        job.close()
