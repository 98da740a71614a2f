"""Python objects encoded off the caller's thread (format/frozen.py): what ``save()`` saves is
the state at call time, whatever the caller does to its objects afterwards; types round-trip
as before; unknown types are refused by ``save()`` naming the key; what only the background
encoding finds fails the save with the key named, and the previous checkpoint stays."""

from __future__ import annotations

import copy
import math
import pickle

import pytest
import torch

import zerostall
from zerostall.errors import SaveFailed, UnsupportedStateError
from zerostall.format.objects import TaggedData
from zerostall.format.frozen import FREEZE_MIN, DeferredTree, Frozen, freeze, skeleton_json, thaw
from zerostall.store.local import LocalTier

N = FREEZE_MIN + 3  # a container this long is frozen whole


def _log(n: int) -> list[dict]:
    return [{"loss": 1.0 / (i + 1), "step": i, "tag": f"s{i}"} for i in range(n)]


def _fails_with(handle, what: str) -> None:
    """``handle.result()`` raises SaveFailed caused by an UnsupportedStateError saying ``what``."""
    with pytest.raises(SaveFailed, match=what) as got:
        handle.result()
    assert isinstance(got.value.__cause__, UnsupportedStateError)


def _state() -> dict:
    cfg = {f"k{i}": {"name": f"v{i}", "dims": [i, i + 1], "on": i % 2 == 0, "lr": 0.1 * i} for i in range(N)}
    return {"model": {"w": torch.arange(4.0)}, "config": cfg, "trainer": {"log_history": _log(N), "step": 3}}


def test_mutating_the_objects_right_after_save_returns_changes_nothing_saved(ckdir):
    state = _state()
    expect = copy.deepcopy(state)
    with zerostall.Checkpointer(ckdir) as ck:
        for step in (1, 2, 3):  # the first save builds the plan; the others reuse it (plan cache)
            h = ck.save(step, state)
            snap = copy.deepcopy(state)
            state["trainer"]["log_history"].append({"loss": -1.0, "step": -1, "tag": "late"})
            state["trainer"]["log_history"][0]["loss"] = 99.0
            state["config"]["k1"]["dims"].append(7)
            state["config"]["k2"]["name"] = "changed"
            state["config"]["new"] = "x"
            state["trainer"]["step"] += 1
            h.result()
            got = ck.load(step=step)
            assert got["config"] == snap["config"] and got["trainer"] == snap["trainer"]
            assert torch.equal(got["model"]["w"], snap["model"]["w"])
    assert expect["config"] != state["config"]  # the mutations happened


def test_a_cleared_container_after_save_returns_keeps_its_saved_items(ckdir):
    hist = _log(1000)
    with zerostall.Checkpointer(ckdir) as ck:
        h = ck.save(1, {"hist": hist, "w": torch.ones(2)})
        hist.clear()
        h.result()
        assert ck.load(step=1)["hist"] == _log(1000)


def test_frozen_containers_round_trip_every_builtin_kind(ckdir):
    odd = [(1, "a"), {1, 2}, frozenset({"x"}), b"\x00\xff", bytearray(b"ab"), math.inf, -0.0, 2 ** 100,
           {1: "int key", (1, 2): "tuple key", False: "bool key", None: "none", 1.5: "float key"}, [], {}, ()]
    big = {f"k{i}": v for i, v in enumerate(odd + list(range(N)))}
    with zerostall.Checkpointer(ckdir) as ck:
        ck.save(1, {"big": big, "tup": tuple(odd + list(range(N)))}).result()
        got = ck.load(step=1)
    assert got["tup"][:4] == ((1, "a"), {1, 2}, frozenset({"x"}), b"\x00\xff")
    assert type(got["tup"]) is tuple and type(got["big"]["k4"]) is bytearray
    assert math.copysign(1.0, got["big"]["k6"]) == -1.0 and got["big"]["k5"] == math.inf
    assert [type(k) for k in got["big"]["k8"]] == [int, tuple, bool, type(None), float]
    assert got["big"] == big


def test_shared_references_are_saved_at_each_place(ckdir):
    shared = list(range(N))
    state = {"a": [shared] * N, "b": {f"x{i}": shared for i in range(N)}}
    with zerostall.Checkpointer(ckdir) as ck:
        h = ck.save(1, state)
        shared.append("late")
        h.result()
        got = ck.load(step=1)
    assert got["a"] == [list(range(N))] * N and got["b"]["x0"] == list(range(N))


def test_a_cycle_inside_a_large_container_is_refused_by_save(ckdir):
    cyc: list = list(range(N))
    cyc.append(cyc)
    assert freeze(cyc) is None
    with zerostall.Checkpointer(ckdir) as ck:
        with pytest.raises(UnsupportedStateError, match="nested deeper than 200"):
            ck.save(1, {"w": torch.ones(1), "cfg": cyc})
        assert not ck._inflight


def test_an_object_of_an_unknown_type_in_a_large_container_is_refused_by_save_naming_the_key(ckdir):
    class Odd:
        pass
    cfg = {f"k{i}": i for i in range(N)}
    cfg["k20"] = Odd()
    with zerostall.Checkpointer(ckdir) as ck:
        with pytest.raises(UnsupportedStateError, match=r"'cfg\.k20' holds a .*Odd"):
            ck.save(1, {"w": torch.ones(1), "cfg": cfg})
    sub = {f"k{i}": i for i in range(N)}
    sub["k20"] = Frozen  # a class: stored by name, as before (not registered: loads as TaggedData)
    with zerostall.Checkpointer(ckdir) as ck:
        ck.save(2, {"cfg": sub}).result()
        assert ck.load(step=2)["cfg"]["k20"] == TaggedData("class", "zerostall.format.frozen.Frozen")


@pytest.mark.parametrize("bad, what", [
    (2 ** 5000, r"'cfg\.7' holds an int of 5001 bits"),
    ({frozenset({1}): 1}, r"dict key frozenset\(\{1\}\) .* under 'cfg\.7'"),
], ids=["big-int", "frozenset-key"])
def test_what_only_the_background_encoding_finds_fails_the_save_naming_the_key(ckdir, bad, what):
    cfg = list(range(N))
    cfg[7] = bad
    with zerostall.Checkpointer(ckdir) as ck:
        ck.save(1, {"w": torch.ones(1), "cfg": list(range(N))}).result()
        h = ck.save(2, {"w": torch.ones(1), "cfg": cfg})  # snapshotted: save() returns
        _fails_with(h, what)
        ck.save(3, {"w": torch.ones(1), "cfg": list(range(N))}).result()  # the pipeline goes on
    assert LocalTier(ckdir).steps() == [1, 3]
    assert zerostall.load(ckdir, step=1)["cfg"] == list(range(N))


def test_nesting_past_the_limit_inside_a_frozen_container_fails_the_save_naming_the_key(ckdir):
    deep: list = []
    node = deep
    for _ in range(250):
        node.append([])
        node = node[0]
    cfg = list(range(N)) + [deep]
    with zerostall.Checkpointer(ckdir) as ck:
        h = ck.save(1, {"cfg": cfg})
        _fails_with(h, r"nested deeper than 200 at 'cfg\.%d\.0\.0" % N)
    assert LocalTier(ckdir).steps() == []


def test_a_manifest_over_the_limit_found_in_the_background_names_the_key(ckdir, monkeypatch):
    """Empty sets pickle to ~1 byte and encode to ~23: under the caller's estimate, over the
    limit once encoded: the save fails at result(), naming the key; nothing is committed."""
    from zerostall.format import manifest as mf
    monkeypatch.setattr(mf, "MAX_MANIFEST_BYTES", 64 << 10)
    state = {"w": torch.ones(2), "trainer": {"sets": [set() for _ in range(5000)], "epoch": 3}}
    with zerostall.Checkpointer(ckdir) as ck:
        h = ck.save(1, state)
        _fails_with(h, r"'trainer\.sets'")
    assert LocalTier(ckdir).steps() == []


def test_an_unchanged_container_reuses_the_last_encoding_and_a_changed_one_is_encoded_again(ckdir):
    state = _state()
    with zerostall.Checkpointer(ckdir) as ck:
        ck.save(1, state).result()
        memo1 = dict(ck._plans._memo)
        state["trainer"]["log_history"].append({"loss": 0.5, "step": 99, "tag": "n"})
        ck.save(2, state).result()
        memo2 = ck._plans._memo
        cfg = freeze(state["config"])
        assert all(memo2[1, p] is memo1[1, p] for p in cfg)  # the config's copy and JSON: reused, not encoded again
        assert all((2, p) in memo2 for p in freeze(state["trainer"]["log_history"]))  # keyed by depth too
        assert ck.load(step=2)["trainer"]["log_history"][-1]["step"] == 99


def test_deferred_tree_encodes_each_part_once_and_keeps_its_error():
    calls = []

    def encode(obj, path):
        calls.append(path)
        if path == ("bad",):
            raise UnsupportedStateError("'bad' is bad")
        return {"j": obj}
    a, b = freeze(list(range(N))), freeze(("x",) * N)
    tree = {"d": [[{"v": "a"}, Frozen(list, a, ("a",))], [{"v": "b"}, Frozen(tuple, b, ("b",))], [{"v": "c"}, {"T": 0}]]}
    parts = [tree["d"][0][1], tree["d"][1][1]]
    lazy = DeferredTree(tree, skeleton_json(tree, parts), parts, encode, lambda t, j: None)
    got, text = lazy.result()  # a plain list: its JSON as it stands; a tuple: by the tree's rules (encode)
    assert got == {"d": [[{"v": "a"}, {"j": list(range(N))}], [{"v": "b"}, {"j": ("x",) * N}], [{"v": "c"}, {"T": 0}]]}
    assert text == '{"d":[[{"v":"a"},{"j":%s}],[{"v":"b"},{"j":%s}],[{"v":"c"},{"T":0}]]}' % (
        str(list(range(N))).replace(" ", ""), str(["x"] * N).replace(" ", "").replace("'", '"'))
    assert lazy.result() == (got, text) and calls == [("b",)]
    again = DeferredTree(tree, skeleton_json(tree, parts), parts, encode, lambda t, j: None, prev=lazy.memo)
    assert again.result() == (got, text) and len(calls) == 2  # the slices reused; the tuple's node built again
    one = [Frozen(tuple, a, ("bad",))]
    bad = DeferredTree({"l": one}, skeleton_json({"l": one}, one), one, encode, lambda t, j: None)
    for _ in range(2):
        with pytest.raises(UnsupportedStateError, match="'bad' is bad"):
            bad.result()


def test_freeze_refuses_every_object_that_is_not_a_builtin_value_and_thaw_resolves_no_global():
    from collections import OrderedDict
    for odd in (torch.ones(1), OrderedDict(a=1), [1, object()], {"a": type("S", (str,), {})("x")}, [print],
                [list], {"d": __import__("argparse").Namespace()}, [1 + 2j]):
        assert freeze(odd) is None, odd
    assert [thaw(p) for p in freeze([int])] == [[int]]  # the types numpy scalars reduce to: a class reference
    assert [thaw(p) for p in freeze({"a": [1, (2, 3), {4}, b"5", None]})] == [{"a": [1, (2, 3), {4}, b"5", None]}]
    with pytest.raises(pickle.UnpicklingError, match="names builtins.print"):
        thaw(pickle.dumps([print], protocol=5))


def test_large_containers_frozen_in_slices_round_trip_and_a_growing_log_reencodes_its_tail_only(ckdir, monkeypatch):
    from zerostall.format import frozen
    monkeypatch.setattr(frozen, "PART_BYTES", 4096)  # many slices
    hist = _log(3000)
    cfg = {f"k{i}": [i, f"v{i}", {"x": i / 3}] for i in range(2000)}
    odd = list(range(1000)) + [(1, 2), {3}, {4: "int key"}] + list(range(500))  # not plain in a late slice
    parts = freeze(hist)
    assert len(parts) > 10 and len(freeze(cfg)) > 10
    with zerostall.Checkpointer(ckdir) as ck:
        ck.save(1, {"hist": hist, "cfg": cfg, "odd": odd, "w": torch.ones(1)}).result()
        memo1 = dict(ck._plans._memo)
        hist.append({"loss": 0.0, "step": 3000, "tag": "t"})
        ck.save(2, {"hist": hist, "cfg": cfg, "odd": odd, "w": torch.ones(1)}).result()
        memo2 = ck._plans._memo
        got = ck.load(step=2)
    assert got["hist"] == hist and list(got["cfg"]) == list(cfg) and got["cfg"] == cfg
    assert got["odd"] == odd and type(got["odd"][1000]) is tuple and got["odd"][1001] == {3}
    new = freeze(hist)
    assert new[:-1] == parts[:-1] and all(memo2[1, p] is memo1[1, p] for p in new[:-1])  # only the tail slice is new
    assert (1, new[-1]) not in memo1


def test_numpy_scalars_in_a_log_history_are_snapshotted_as_their_python_values(ckdir):
    """Metrics functions return np.float64 and friends: snapshotted (not walked on the caller's
    thread) as the Python values the tree stores them as; a long double is still refused by
    save() naming the key, and a pickle naming any other global is refused by thaw."""
    import numpy as np
    hist = [{"eval_f1": np.float64(i / 7), "n": np.int64(i), "ok": np.bool_(i % 2), "h": np.float16(0.5),
             "f32": np.float32(i / 3), "name": np.str_(f"r{i}")} for i in range(N)]
    assert freeze(hist) is not None
    with zerostall.Checkpointer(ckdir) as ck:
        h = ck.save(1, {"hist": hist})
        hist[0]["eval_f1"] = np.float64(-1)
        h.result()
        got = ck.load(step=1)["hist"]
    assert got[3] == {"eval_f1": 3 / 7, "n": 3, "ok": True, "h": 0.5, "f32": float(np.float32(1.0)), "name": "r3"}
    assert [type(v) for v in got[3].values()] == [float, int, bool, float, float, str]
    assert got[0]["eval_f1"] == 0.0
    bad = [np.longdouble(1)] + list(range(N))
    assert freeze(bad) is None
    with zerostall.Checkpointer(ckdir) as ck:
        with pytest.raises(UnsupportedStateError, match=r"'x\.0' holds a numpy float128"):
            ck.save(2, {"x": bad})
    with pytest.raises(pickle.UnpicklingError, match="names builtins.eval"):
        thaw(pickle.dumps([eval], protocol=5))


# -- adversarial review (adv): each failed before its fix ------------------------------------
def test_a_pickle_buffer_in_a_large_container_is_refused_by_save_as_in_a_small_one(ckdir):
    """The C pickler writes a ``PickleBuffer`` itself (no ``reducer_override``): frozen, it came
    back as a bytearray (or bytes), a type the walk refuses; now refused alike, naming the key."""
    for buf in (pickle.PickleBuffer(bytearray(b"ab")), pickle.PickleBuffer(b"ab")):
        for n in (1, N):
            with zerostall.Checkpointer(ckdir) as ck:
                with pytest.raises(UnsupportedStateError, match=r"'cfg\.0' holds a pickle\.PickleBuffer"):
                    ck.save(1, {"cfg": [buf] + list(range(n - 1))})
        assert freeze([buf] * N) is None
    assert LocalTier(ckdir).steps() == []


def _nested(depth: int) -> list:
    x: list = [0]
    for _ in range(depth):
        x = [x]
    return x


def _wrapped(x: object, depth: int) -> object:
    for _ in range(depth):
        x = [x]
    return x


def test_a_frozen_container_too_deep_where_it_sits_fails_whatever_was_encoded_before(ckdir):
    """The same snapshot bytes at two depths: the encoding reused for equal bytes (in one save,
    and from the last save) skipped the depth check of the deeper one, so a state nested past
    200 was saved or refused depending on what sat beside it or was saved before."""
    cfg = [_nested(150) for _ in range(N)]  # plain at depth 1; past 200 at depth 101
    deep = _wrapped(cfg, 100)
    for i, before in enumerate(([], [{"cfg": cfg}])):  # beside it in one save; saved the step before
        with zerostall.Checkpointer(f"{ckdir}{i}") as ck:
            for step, state in enumerate(before, 1):
                ck.save(step, state).result()
            _fails_with(ck.save(5, {"cfg": cfg, "deep": deep} if not before else {"deep": deep}),
                        r"nested deeper than 200 at 'deep\.0\.0")
            assert LocalTier(f"{ckdir}{i}").steps() == list(range(1, len(before) + 1))
    with zerostall.Checkpointer(f"{ckdir}-alone") as ck:  # as it fails alone
        _fails_with(ck.save(1, {"deep": deep}), r"nested deeper than 200 at 'deep\.0\.0")
