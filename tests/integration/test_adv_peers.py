"""Adversarial checks of peer replicas (adv1): 4 simulated nodes x 1 rank on gloo, the
harness of test_peers.py."""

import os

import pytest

from tests.helpers import flip_byte

from .test_peers import _launch, _ok


def test_flipped_byte_in_one_nodes_newest_local_shard_still_loads(tmp_path):
    """n1's own rank-00001.shard of step 2 gets a flipped payload byte (same size, so it still
    looks complete); an intact copy is held by its peer. load() must restore on every rank:
    step 2 (from the peer copy) or step 1 everywhere -- never fail the whole job."""
    base = str(tmp_path / "job")
    for d in _ok(_launch("save", base, tmp_path, {"ZS_REPLICAS": "2"})):
        assert d["protected"] == {"1": True, "2": True}, d
    flip_byte(os.path.join(base, "n1", "step-2", "rank-00001.shard"), 8192)
    docs = _ok(_launch("load", base, tmp_path, {"ZS_REPLICAS": "2"}))
    for d in docs:
        assert d.get("error") is None, d
        assert d["equal"] is True, d
    assert len({d["step"] for d in docs}) == 1, docs
