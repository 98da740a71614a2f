"""What is saved is what comes back: every dtype, layout, view kind and Python leaf type,
bit for bit and type for type; what cannot be stored is refused in save(), naming the key,
before anything is queued."""

import collections
import math
import os

import numpy as np
import pytest
import torch

import zerostall
from zerostall.store.local import LocalTier
from zerostall.errors import ConfigError, UnsupportedStateError
from zerostall.format.dtypes import SUPPORTED_DTYPES
from zerostall.format.validate import MAX_INT_BITS, NUMPY_DTYPES
from tests.helpers import same

pytestmark = pytest.mark.timeout(300)


def _random(dtype, shape, seed=0):
    g = torch.Generator().manual_seed(seed)
    n = math.prod(shape)
    raw = torch.randint(0, 256, (n * torch.empty((), dtype=dtype).element_size(),), dtype=torch.uint8, generator=g)
    return raw.view(dtype).reshape(shape) if n else torch.empty(shape, dtype=dtype)


def roundtrip(ckdir, state, step=1):
    zerostall.save(ckdir, state, step=step, overwrite=True)
    return zerostall.load(ckdir, step=step)


@pytest.mark.parametrize("dtype", SUPPORTED_DTYPES, ids=str)
def test_every_dtype_bit_exact(ckdir, dtype):
    state = {"x": _random(dtype, (3, 5), 1), "scalar": _random(dtype, (), 2), "empty": _random(dtype, (0, 4)),
             "odd": _random(dtype, (4097,), 3)}
    same(state, roundtrip(ckdir, state))


def test_every_layout_and_view_kind(ckdir):
    base = torch.arange(4 * 6 * 8, dtype=torch.float32).reshape(4, 6, 8)
    c = torch.randn(5, 3, dtype=torch.complex64, generator=torch.Generator().manual_seed(0))
    state = {
        "contiguous": base,
        "transposed": base.transpose(0, 2),
        "permuted": base.permute(2, 0, 1),
        "strided_slice": base[:, ::2, 1::3],
        "offset_view": base.reshape(-1)[7:50],
        "expanded": torch.arange(3.0).expand(4, 3),
        "zero_stride_scalar": torch.tensor(2.5).expand(5),
        "channels_last": torch.randn(2, 3, 4, 5).to(memory_format=torch.channels_last),
        "zero_dim": torch.tensor(3.25),
        "zero_elements_odd_shape": torch.empty(7, 0, 3),
        "conj_view": c.conj(),
        "conj_base": c,                       # x and x.conj() share storage: never merged
        "neg_view": torch._neg_view(base[0]),
        "conj_of_transpose": c.t().conj(),
        "parameter": torch.nn.Parameter(torch.randn(4, 4)),
        "bool": torch.tensor([True, False, True]),
        "big_strided": torch.randn(300, 700).t(),   # > one chunk of the strided copy
    }
    out = roundtrip(ckdir, state)
    same({k: v.detach() if isinstance(v, torch.nn.Parameter) else v for k, v in state.items()},
         {k: v for k, v in out.items()})
    assert torch.equal(out["conj_view"], c.conj().resolve_conj())
    assert not torch.equal(out["conj_view"], out["conj_base"])


def test_tied_weights_restored_as_one_tensor(ckdir):
    emb = torch.randn(10, 4)
    out = roundtrip(ckdir, {"emb": emb, "head": emb, "other_view": emb[1:]})
    assert out["emb"] is out["head"]
    assert torch.equal(out["other_view"], emb[1:])


@pytest.mark.parametrize("dtype", sorted(NUMPY_DTYPES))
def test_numpy_arrays_every_dtype_and_shape(ckdir, dtype):
    rng = np.random.default_rng(0)
    a = (rng.random((4, 6)) * 100).astype(dtype)
    state = {"a": a, "zero_d": np.array(a.flat[3], dtype=dtype), "fortran": np.asfortranarray(a),
             "slice": a[::2, 1::2], "empty": np.zeros((0, 3), dtype=dtype)}
    out = roundtrip(ckdir, state)
    same(state, out)
    assert out["zero_d"].shape == ()


def test_python_leaf_types(ckdir):
    Point = collections.namedtuple("Point", "x y")
    state = {
        "none": None, "true": True, "false": False,
        "ints": [0, -1, 2 ** 62, -(2 ** 63), 2 ** 100, (1 << MAX_INT_BITS) - 1],
        "floats": [0.0, -0.0, 1e308, 5e-324, 1.0 / 3, float("nan"), float("inf"), float("-inf")],
        "strs": ["", "plain", "ünï\u00e7ødé ✓ 🚀", "nul\x00byte", "esc\x1b[31m", "\ud800 lone surrogate"],
        "tuple": (1, "a", (2.5, None)),
        "namedtuple_as_tuple": tuple(Point(1, 2)),
        "torch_size": tuple(torch.Size([3, 4])),
        "order": {"b": 1, "a": 2, "c": {"z": 1, "y": 2}},
        "int_keys": {3: "three", -1: "minus", 2 ** 40: "big"},
        "mixed_keys": {1.5: "f", True: "bool", None: "none", (1, "t"): "tuple", "s": "str"},
        "empty": {"d": {}, "l": [], "t": ()},
        "deep": [[[[[{"x": [1, [2, [3]]]}]]]]],
        "log_history": [{"loss": 1.0 / (i + 1), "step": i} for i in range(1000)],
        "list_with_tensor": [1, torch.ones(2), "x"],
    }
    same(state, roundtrip(ckdir, state))


def test_numpy_scalars_become_python_values(ckdir):
    out = roundtrip(ckdir, {"f": np.float32(1.5), "i": np.int64(7), "b": np.bool_(True)})
    assert out == {"f": 1.5, "i": 7, "b": True}
    assert type(out["f"]) is float and type(out["i"]) is int and type(out["b"]) is bool


@pytest.mark.parametrize("bad,key,msg", [
    ({"w": object()}, "w", "cannot be stored without pickle"),
    ({"a": {"b": [1, lambda: 0]}}, "a.b.1", "cannot be stored"),
    ({"n": torch.nested.nested_tensor([torch.ones(2), torch.ones(3)])}, "n", "nested tensor"),
    ({"big": 1 << (MAX_INT_BITS + 1)}, "big", "bits"),
    ({"k": {1 << 5000: 1}}, "k", "bits"),
    ({"be": np.arange(3, dtype=">f4")}, "be", "byte order"),
    ({"obj": np.array([object()], dtype=object)}, "obj", "Python objects"),
    ({"meta": torch.empty(3, device="meta")}, "meta", "meta tensor"),
    ({"sparse": torch.eye(3).to_sparse()}, "sparse", "layout"),
])
def test_refused_in_save_naming_the_key(ckdir, bad, key, msg):
    with zerostall.Checkpointer(ckdir) as ck:
        with pytest.raises(UnsupportedStateError, match=msg) as ei:
            ck.save(1, bad)
        assert repr(key) in str(ei.value)
        assert not ck._inflight
    assert not os.path.exists(os.path.join(ckdir, "step-1")) and not os.path.exists(os.path.join(ckdir, "step-1.partial"))


@pytest.mark.parametrize("step", [2 ** 63, -1, 1.0, True, "3"])
def test_step_range_checked_before_queueing(ckdir, step):
    with zerostall.Checkpointer(ckdir) as ck:
        with pytest.raises(ConfigError, match="step="):
            ck.save(step, {"x": torch.ones(2)})
        assert not ck._inflight  # nothing queued (the staging pool is leased at construction now)
    zerostall.save(ckdir, {"x": torch.ones(2)}, step=2 ** 63 - 1)
    assert zerostall.load(ckdir)["x"].sum() == 2


def test_metadata_must_be_plain_json(ckdir):
    with zerostall.Checkpointer(ckdir) as ck:
        with pytest.raises(UnsupportedStateError, match="metadata"):
            ck.save(1, {"x": torch.ones(1)}, metadata={"when": object()})
        meta = {"run": "a", "n": [1, 2]}
        h = ck.save(2, {"x": torch.ones(1)}, metadata=meta)
        meta["n"].append(3)  # the save holds a snapshot, not the caller's object
        h.result()
    assert LocalTier(ckdir).read_manifest(2).user_metadata == {"run": "a", "n": [1, 2]}


def test_plain_values_are_snapshotted_at_save(ckdir):
    hist = [{"loss": 1.0}]
    with zerostall.Checkpointer(ckdir) as ck:
        h = ck.save(1, {"hist": hist, "w": torch.ones(2)})
        hist.append({"loss": 0.5})
        hist[0]["loss"] = 99.0
        h.result()
    assert zerostall.load(ckdir)["hist"] == [{"loss": 1.0}]


def test_manifest_size_limit_on_save_names_the_key(ckdir, monkeypatch):
    from zerostall.format import manifest as mf
    monkeypatch.setattr(mf, "MAX_MANIFEST_BYTES", 64 << 10)
    state = {"model": {"w": torch.ones(2)}, "trainer": {"log_history": [{"loss": float(i)} for i in range(10000)],
                                                        "epoch": 3}}
    with zerostall.Checkpointer(ckdir) as ck:
        with pytest.raises(UnsupportedStateError, match=r"'trainer\.log_history'.*tensors"):
            ck.save(1, state)
        assert not ck._inflight
    assert LocalTier(ckdir).steps() == []


def test_non_contiguous_tensor_streams_within_the_budget(ckdir):
    """A 64 MiB transposed tensor with a 16 MiB staging budget: the save's peak RSS grows by
    chunks, not by a whole contiguous copy (which would add 64 MiB)."""
    import gc
    big = torch.randn(4096, 4096).t()  # 64 MiB, not contiguous
    with zerostall.Checkpointer(ckdir, staging=zerostall.StagingConfig(budget_bytes=16 << 20)) as ck:
        ck.prepare({"big": big})
        gc.collect()
        try:
            with open("/proc/self/clear_refs", "w") as f:
                f.write("5")
        except OSError as exc:
            pytest.skip(f"cannot reset the RSS high-water mark: {exc}")
        base = _vm("VmRSS")
        ck.save(1, {"big": big}).result()
        grew = _vm("VmHWM") - base
    assert grew < 32 << 20, f"peak RSS grew by {grew >> 20} MiB"  # a whole copy: +64 MiB
    assert torch.equal(zerostall.load(ckdir)["big"], big)


def _vm(field):
    for line in open("/proc/self/status"):
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    raise AssertionError(field)
