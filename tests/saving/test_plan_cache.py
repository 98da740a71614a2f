"""The Checkpointer's plan cache (staging/plan.py ``PlanCache``): same layout as a fresh plan,
the newly walked tensors, rebuilt on any change, no tensor kept alive."""

import pytest
import torch

def _state():
    w = torch.arange(12, dtype=torch.float32).reshape(3, 4)
    return {"model": {"w": w, "tied": w, "b": torch.ones(5)}, "opt": {"state": {0: {"step": torch.tensor(3.0)}},
                                                                      "param_groups": [{"lr": 0.1, "params": [0]}]}}


def _same_layout(a, b):
    return a.items == b.items and a.file_bytes == b.file_bytes and a.tree_json == b.tree_json \
        and [lf.key for lf in a.leaves] == [lf.key for lf in b.leaves]


def test_plan_cache_reuses_the_layout_with_the_new_walks_tensors():
    from zerostall.saving.plan import build_plan
    from zerostall.saving.plan_cache import PlanCache
    pc, st = PlanCache(), _state()
    first = pc.plan(st)
    again = pc.plan(st)
    assert _same_layout(first, again) and _same_layout(again, build_plan(st))
    assert [lf.tensor.data_ptr() for lf in again.leaves] == [lf.tensor.data_ptr() for lf in build_plan(st).leaves]
    assert len(again.leaves) == 3  # the tied weight is stored once, cached or not
    st["model"]["b"] = torch.zeros(5)  # reallocated: the walk sees a new address
    moved = pc.plan(st)
    assert moved.leaves[[lf.key for lf in moved.leaves].index("model.b")].tensor.data_ptr() == st["model"]["b"].data_ptr()


def test_plan_cache_rebuilds_when_a_plain_value_or_shape_changes():
    import json
    from zerostall.saving.plan import build_plan
    from zerostall.saving.plan_cache import PlanCache
    pc, st = PlanCache(), _state()
    pc.plan(st)
    st["opt"]["param_groups"][0]["lr"] = 0.05
    assert '0.05' in pc.plan(st).tree_json
    st["opt"]["param_groups"][0]["lr"] = 0.0
    pc.plan(st)
    st["opt"]["param_groups"][0]["lr"] = -0.0  # equal to 0.0 in Python, not in the manifest
    assert pc.plan(st).tree_json == build_plan(st).tree_json and "-0.0" in pc.plan(st).tree_json
    st["model"]["b"] = torch.ones(6)
    assert pc.plan(st).items[-1].nbytes == build_plan(st).items[-1].nbytes
    st["extra"] = {"new": torch.ones(2)}
    assert _same_layout(pc.plan(st), build_plan(st)) and "extra.new" in json.dumps(
        [lf.key for lf in pc.plan(st).leaves])


def test_plan_cache_keeps_no_tensor_alive_and_steps_aside_for_odd_states():
    import gc
    import weakref

    import numpy as np
    from zerostall.errors import UnsupportedStateError
    from zerostall.saving.plan_cache import PlanCache
    pc, st = PlanCache(), _state()
    pc.plan(st)
    pc.plan(st)
    ref = weakref.ref(st["model"]["b"])
    del st
    gc.collect()
    assert ref() is None
    arr = {"a": np.arange(4.0), "t": torch.ones(2)}  # numpy: encode_tree decides every time
    assert [lf.numpy for lf in pc.plan(arr).leaves] == [True, False] == [lf.numpy for lf in pc.plan(arr).leaves]
    with pytest.raises(UnsupportedStateError):
        pc.plan({"x": object()})


def test_plan_pauses_the_gc_only_while_planning_and_keeps_a_disabled_gc_disabled():
    import gc
    import threading
    from zerostall.saving.plan_cache import PlanCache
    seen = []
    cb = lambda phase, info: seen.append(info["generation"]) if phase == "start" else None  # noqa: E731
    assert gc.isenabled()
    gc.callbacks.append(cb)
    try:
        pc = PlanCache()
        st = {"opt": {f"s.{i}": torch.ones(1) for i in range(3000)}}
        pc.plan(st)
        seen.clear()
        pc.plan(st)  # many times the gen-0 threshold of allocations: at most the one due at the end
        assert len(seen) <= 1, seen
        assert gc.isenabled()
        threads = [threading.Thread(target=PlanCache().plan, args=(st,)) for _ in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert gc.isenabled()  # concurrent planners: re-enabled when the last is done
        gc.disable()
        try:
            pc.plan(st)
            assert not gc.isenabled()
        finally:
            gc.enable()
    finally:
        gc.callbacks.remove(cb)


def test_plan_cache_reused_for_one_ranks_share_and_tied_weights():
    from zerostall.saving.plan import build_plan
    from zerostall.saving.plan_cache import PlanCache
    st = _state()
    st["more"] = {f"m{i}": torch.full((i + 1,), float(i)) for i in range(6)}
    for rank in (0, 1):
        pc = PlanCache()
        pc.plan(st, rank=rank, world_size=2, replicated=True)
        again = pc.plan(st, rank=rank, world_size=2, replicated=True)
        fresh = build_plan(st, rank=rank, world_size=2, replicated=True)
        assert _same_layout(again, fresh)
        assert [lf.tensor.data_ptr() for lf in again.leaves] == [lf.tensor.data_ptr() for lf in fresh.leaves]
        assert again.devices == {"cpu"}


def test_plan_cache_never_reuses_a_plan_for_a_nested_sparse_or_neg_tensor():
    """The signature takes no layout/is_nested pass: such tensors make its maps raise (or,
    for neg/conj views, return None), so the plan is built again and encode_tree refuses or
    resolves them exactly as on a first save."""
    from zerostall.errors import UnsupportedStateError
    from zerostall.saving.plan_cache import PlanCache, _tensor_sig
    odd = {"sparse": torch.eye(3).to_sparse(), "csr": torch.eye(3).to_sparse_csr(),
           "nested": torch.nested.nested_tensor([torch.randn(2), torch.randn(3)]),
           "jagged": torch.nested.nested_tensor([torch.randn(2, 4), torch.randn(3, 4)], layout=torch.jagged)}
    for name, t in odd.items():
        try:
            sig = _tensor_sig([torch.ones(2), t])
        except Exception:  # noqa: BLE001 - raising is how the cache steps aside
            sig = None
        assert sig is None, name
        pc, st = PlanCache(), {f"k{i}": torch.ones(2) for i in range(40)}
        pc.plan(st)
        pc.plan(st)  # cached
        st["k3"] = t
        with pytest.raises(UnsupportedStateError, match="k3"):
            pc.plan(st)
    c = torch.randn(4, dtype=torch.complex64)
    pc, st = PlanCache(), {"c": c, "x": torch.ones(2)}
    pc.plan(st)
    pc.plan(st)
    st["c"] = c.conj()  # same address, shape, strides, dtype: only the conj bit differs
    leaf = pc.plan(st).leaves[0]
    assert not leaf.tensor.is_conj() and torch.equal(leaf.tensor, c.conj().resolve_conj())


def test_a_reused_plans_leaves_read_like_a_tuple_of_leaves():
    from zerostall.format.tree import TensorLeaf
    from zerostall.saving.plan import build_plan
    from zerostall.saving.plan_cache import Leaves, PlanCache, plan_tensors
    pc, st = PlanCache(), _state()
    pc.plan(st)
    again = pc.plan(st)
    fresh = build_plan(st)
    assert isinstance(again.leaves, Leaves) and len(again.leaves) == len(fresh.leaves) == 3
    for got in (list(again.leaves), [again.leaves[i] for i in range(3)], list(again.leaves[0:3]),
                list(again.leaves + ())):
        assert all(type(lf) is TensorLeaf for lf in got)
        assert [(lf.key, lf.numpy, lf.tensor.data_ptr()) for lf in got] == \
            [(lf.key, lf.numpy, lf.tensor.data_ptr()) for lf in fresh.leaves]
    assert [t.data_ptr() for t in plan_tensors(again)] == [t.data_ptr() for t in plan_tensors(fresh)]
    assert not any(t.requires_grad for t in plan_tensors(again))


def test_entries_bound_in_bulk_equals_the_per_entry_bound():
    from zerostall.format.tree import TensorLeaf
    from zerostall.saving.plan import _entries_bound, entry_bound
    plain = [TensorLeaf(f"model.layer{i}.w", torch.ones([2] * (i % 4))) for i in range(50)]
    for odd in ([], ['q"uote'], ["back\\slash"], ["\u00e9"], ["tab\t"]):
        leaves = plain + [TensorLeaf(k, torch.ones(3)) for k in odd]
        assert _entries_bound(leaves) == sum(entry_bound(lf.key, lf.tensor.dim()) for lf in leaves)
    assert _entries_bound([]) == 0


def test_changed_plain_values_make_a_new_tree_on_the_same_layout(monkeypatch):
    """A step counter, a learning rate, a growing log history: the plan cache keeps the tensor
    layout and encodes only the tree again, which equals a fresh plan's, tensors included."""
    from zerostall.saving import plan as plan_mod
    from zerostall.saving.plan import build_plan
    from zerostall.saving.plan_cache import PlanCache
    g = torch.Generator().manual_seed(0)
    model = {f"w{i}": torch.randn(3, generator=g) for i in range(60)}
    st = {"model": model, "tied": model["w1"], "opt": {"state": {0: {"step": torch.tensor(1.0)}},
                                                       "param_groups": [{"lr": 0.1, "params": [0]}]},
          "step": 1, "log": [{"loss": 1.5}], "cfg": {"name": "run", "sizes": [1, 2]}}
    pc = PlanCache()
    pc.plan(st)
    builds = []
    real = plan_mod.build_plan
    monkeypatch.setattr("zerostall.saving.plan_cache.build_plan", lambda *a, **k: builds.append(1) or real(*a, **k))

    def edits():
        st["step"] += 1
        yield
        st["log"].append({"loss": 1.25, "note": "x"})
        yield
        st["opt"]["param_groups"][0]["lr"] = -0.0
        yield
        st["cfg"]["sizes"] = {"nested": [True, None, 2 ** 40]}
        yield
        st["cfg"] = "flat"
        yield
    for _ in edits():
        got = pc.plan(st)
        fresh = build_plan(st)
        assert got.tree == fresh.tree and got.tree_json == fresh.tree_json and _same_layout(got, fresh)
        assert [lf.tensor.data_ptr() for lf in got.leaves] == [lf.tensor.data_ptr() for lf in fresh.leaves]
        assert pc.plan(st).tree_json == fresh.tree_json  # and cached again
    assert builds == []  # never rebuilt: the tensors did not change
    st["cfg"] = {"t": torch.ones(2)}  # a tensor where a plain value was: the structure changed
    got = pc.plan(st)
    assert builds == [1] and _same_layout(got, build_plan(st))


def test_values_only_rebuild_still_refuses_what_a_fresh_plan_refuses():
    from zerostall.errors import UnsupportedStateError
    from zerostall.saving.plan_cache import PlanCache
    st = {"m": {f"w{i}": torch.ones(2) for i in range(40)}, "n": 1}
    pc = PlanCache()
    pc.plan(st)
    st["n"] = 2 ** 5000  # over the plain int limit
    with pytest.raises(UnsupportedStateError, match="'n'"):
        pc.plan(st)
    st["n"] = 3
    assert '"n"' in pc.plan(st).tree_json


def test_a_first_plan_freezes_each_config_container_once(monkeypatch):
    # the plan cache's walk snapshots a large builtin container; the first plan it builds reuses
    # that snapshot instead of pickling the container a second time on the caller's thread
    from zerostall.format import frozen as frozen_mod, tree as tree_mod
    from zerostall.saving import plan_cache as pc_mod
    from zerostall.saving.plan import build_plan
    from zerostall.saving.plan_cache import PlanCache
    calls = []
    real = frozen_mod.freeze

    def counting(x, *a, **k):
        calls.append(id(x))
        return real(x, *a, **k)
    monkeypatch.setattr(tree_mod, "freeze", counting)
    monkeypatch.setattr(pc_mod, "freeze", counting)
    config = {f"k{i}": [i, str(i), float(i)] for i in range(40)}
    st = {"model": {"w": torch.ones(4)}, "config": config}
    plan = PlanCache().plan(st)
    assert calls.count(id(config)) == 1, calls
    assert plan.lazy is not None and plan.lazy.result()[1] == build_plan(st).lazy.result()[1]  # the same JSON
