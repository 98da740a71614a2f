"""format/bulk.py: a dict of plain tensors taken in bulk encodes exactly as the per-tensor
path would (same tree, same leaves in the same order, ties deduplicated the same way), and
everything unusual falls back to the per-tensor path (which raises its precise errors)."""

import pytest
import torch

from zerostall.errors import UnsupportedStateError
from zerostall.format import bulk
from zerostall.format.tree import encode_tree
from zerostall.saving.plan_cache import _tensor_sig, _walk


def _per_tensor(state, monkeypatch):
    with monkeypatch.context() as m:
        m.setattr(bulk, "BULK_MIN", 10**9)
        return encode_tree(state, occ := [])[0:2] + (occ,)


def _columns(state):
    """The plan cache's signature reads of ``state`` (what a first save passes down), or None."""
    tensors = []
    if not _walk(state, [], tensors, 0, []):
        return None
    tsig = _tensor_sig(tensors)
    return (tensors, *tsig) if tsig is not None else None


def _check_same(state, monkeypatch, copied=()):
    tree, leaves = encode_tree(state, occ := [])
    want_tree, want_leaves, want_occ = _per_tensor(state, monkeypatch)
    cols = _columns(state)
    got = [(tree, leaves, occ)]
    if cols is not None:  # the first save's path: attributes read from the signature's columns
        got.append(encode_tree(state, occ2 := [], columns=cols) + (occ2,))
    for tree, leaves, occ in got:
        _same_as(tree, leaves, occ, want_tree, want_leaves, want_occ, copied)
    return got[0][:2]


def _same_as(tree, leaves, occ, want_tree, want_leaves, want_occ, copied):
    assert tree == want_tree
    assert occ == want_occ
    assert [lf.key for lf in leaves] == [lf.key for lf in want_leaves]
    for a, b in zip(leaves, want_leaves):
        assert a.numpy == b.numpy and a.tensor.dtype == b.tensor.dtype and a.tensor.shape == b.tensor.shape
        assert torch.equal(a.tensor, b.tensor)
        if a.key not in copied:  # a resolved conj view is a new copy each time
            assert a.tensor.data_ptr() == b.tensor.data_ptr() and a.tensor.stride() == b.tensor.stride()
        assert not a.tensor.requires_grad


def _many(n=40, shape=(3, 2), seed=0, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    return {f"w{i}": torch.randn(*shape, generator=g).to(dtype) for i in range(n)}


def test_bulk_taken_for_a_dict_of_tensors(monkeypatch):
    calls = []
    real = bulk.bulk_tensors
    monkeypatch.setattr("zerostall.format.tree.bulk_tensors", lambda x, seen, *cols: calls.append(r := real(x, seen, *cols)) or r)
    state = {"model": _many(), "optim": {"state": _many(50, (4,), 1)}, "lr": 0.1}
    tree, leaves = encode_tree(state)
    assert sum(r is not None for r in calls) == 2  # both containers of tensors went in bulk
    assert [lf.key for lf in leaves][:2] == ["model.w0", "model.w1"] and leaves[40].key == "optim.state.w0"


def test_bulk_equals_per_tensor_path(monkeypatch):
    p = torch.nn.Parameter(torch.randn(5))
    state = {"model": {**_many(), "p": p}, "o": {"s": _many(50, (4,), 1)}, "bf": _many(33, (2, 2), 2, torch.bfloat16),
             "nc": {f"k{i}": torch.randn(4, 6)[:, ::2] for i in range(40)}}
    _check_same(state, monkeypatch)


def test_ties_within_and_across_containers_dedup_alike(monkeypatch):
    a, b = _many(40, seed=3), _many(40, seed=4)
    a["tied"] = a["w3"]  # inside one container: per-tensor path
    b["w0"] = a["w5"]  # across containers
    c = _many(40, seed=5)
    c["view"] = a["w7"].view(-1)  # same address, other shape: not a tie
    tree, leaves = _check_same({"a": a, "b": b, "c": c}, monkeypatch)
    assert len(leaves) == 40 + 39 + 41


def test_odd_values_fall_back_and_errors_are_the_per_tensor_paths():
    base = _many()
    assert bulk.bulk_tensors({**base, "z": torch.zeros(0)}, {}) is None  # empty: no identity
    assert bulk.bulk_tensors({**base, 1: torch.ones(1)}, {}) is None  # an int key
    assert bulk.bulk_tensors({**base, "c": torch.randn(2, dtype=torch.complex64).conj()}, {}) is None
    assert bulk.bulk_tensors({**base, "n": torch._neg_view(torch.randn(2))}, {}) is None
    assert bulk.bulk_tensors({**base, "m": torch.empty(2, device="meta")}, {}) is None
    assert bulk.bulk_tensors({**base, "s": torch.eye(2).to_sparse()}, {}) is None
    assert bulk.bulk_tensors({**base, "x": 1.0}, {}) is None
    with pytest.raises(UnsupportedStateError, match="'m.meta'.*meta tensor"):
        encode_tree({"m": {**base, "meta": torch.empty(2, device="meta")}})
    with pytest.raises(UnsupportedStateError, match="'m.s'.*to_dense"):
        encode_tree({"m": {**base, "s": torch.eye(2).to_sparse()}})


def test_conj_and_neg_views_resolved_like_per_tensor(monkeypatch):
    state = {"m": {**_many(), "c": torch.randn(3, dtype=torch.complex64).conj()}}
    tree, leaves = _check_same(state, monkeypatch, copied=("m.c",))
    assert not leaves[-1].tensor.is_conj()


def test_first_plan_reads_the_signature_columns_and_lays_out_alike(monkeypatch):
    from zerostall.saving.plan import build_plan
    from zerostall.saving.plan_cache import PlanCache
    a = _many(40, seed=6)
    a["tied"] = a["w1"]
    state = {"model": _many(50, (2, 3), 7), "opt": {"s": a, "l": [torch.ones(2), a["w2"]]}, "step": 3}
    taken = []
    real = bulk._from_columns
    monkeypatch.setattr(bulk, "_from_columns", lambda *x: taken.append(r := real(*x)) or r)
    plan = PlanCache().plan(state)  # a first save: columns passed down
    assert [r is not None for r in taken] == [True, False]  # "model" in bulk from columns; "s" (a tie): per tensor
    want = build_plan(state)
    assert plan.tree_json == want.tree_json and plan.tree == want.tree
    assert plan.items == want.items and plan.file_bytes == want.file_bytes
    assert [lf.key for lf in plan.leaves] == [lf.key for lf in want.leaves]
    assert all(x.tensor.data_ptr() == y.tensor.data_ptr() for x, y in zip(plan.leaves, want.leaves))


def test_columns_of_other_tensors_are_not_used(monkeypatch):
    state = {"m": _many(40, seed=8)}
    stale = _columns({"m": _many(40, seed=8)})  # equal values, other tensor objects
    taken = []
    monkeypatch.setattr(bulk, "_from_columns", lambda *x: taken.append(x))
    tree, leaves = encode_tree(state, columns=stale)
    assert taken == [] and [lf.tensor.data_ptr() for lf in leaves] == [t.data_ptr() for t in state["m"].values()]


def test_large_bulk_nodes_json_spliced_byte_for_byte():
    import json
    from zerostall.saving.plan import build_plan
    from zerostall.saving.plan_cache import PlanCache
    big = {f"layer.{i}.w\u00e9\"\\\x00" if i % 97 == 0 else f"layer.{i}.w": torch.full((2,), float(i))
           for i in range(bulk.TEXT_MIN + 5)}
    state = {"model": big, "opt": {"state": _many(bulk.TEXT_MIN, (1,), 9), "lr": 0.5, "n": [1, None]},
             "mark": "\x00zsbulk", "s": _many(40, seed=10)}
    for plan in (build_plan(state), PlanCache().plan(state)):
        assert plan.tree_json == json.dumps(plan.tree, separators=(",", ":"), allow_nan=False)
        assert plan.tree == build_plan(state).tree  # the nodes' pairs are back in place
        assert plan.tree["d"][0][1]["d"][97] == [{"v": "layer.97.w\u00e9\"\\\x00"}, {"T": 97}]
    texts = []
    tree, leaves = encode_tree(state, texts=texts)
    assert len(texts) == 2 and [n is tree["d"][0][1] for n, _ in texts] == [True, False]
