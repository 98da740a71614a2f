"""The per-rank merge of incremental fragments (dist/commit.py): every rank's references end up
in one manifest, and what each rank's base may still borrow reaches rank 0's retention."""

import torch

from zerostall.distributed.commit import merge, peer_protected
from zerostall.format.tree import encode_tree
from zerostall.format.manifest import Manifest


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
