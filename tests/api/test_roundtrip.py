"""Bit-exact round trips of every stored dtype and shape, through every engine."""

import math

import pytest
import torch

import zerostall
from zerostall.format.dtypes import SUPPORTED_DTYPES


def _rand(shape, dtype, g):
    n = math.prod(shape)
    raw = torch.randint(0, 256, (n * torch.empty((), dtype=dtype).element_size(),), dtype=torch.uint8, generator=g)
    if dtype == torch.bool:
        return (raw[:n] & 1).bool().reshape(shape)
    return raw.view(dtype).reshape(shape)


def _state(g):
    sd = {}
    for dt in SUPPORTED_DTYPES:
        name = str(dt).split(".")[1]
        sd[name] = _rand((3, 333), dt, g)  # 999 elements: not a multiple of 512/4096 bytes
    base = torch.randn(64, 64, generator=g)
    sd["empty"] = torch.empty(0, 5)
    sd["scalar"] = torch.tensor(2.5)
    sd["noncontig"] = base.t()
    sd["strided"] = base[::3, 1::2]
    sd["tied_a"] = base
    sd["tied_b"] = base
    sd["nested"] = {"list": [torch.arange(7), {"deep": (torch.ones(3, dtype=torch.int8), "x", 1.5)}],
                    "plain": {"lr": 3e-4, "name": "gpt", "n": None, 4: [1, 2, 3]}}
    sd["odd"] = torch.randn(12345, generator=g)
    return sd


def _assert_same(a, b):
    assert type(a) is type(b)
    if isinstance(a, torch.Tensor):
        assert a.dtype == b.dtype and a.shape == b.shape
        assert torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8)) if a.numel() else True
    elif isinstance(a, dict):
        assert a.keys() == b.keys()
        for k in a:
            _assert_same(a[k], b[k])
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b)
        for x, y in zip(a, b):
            _assert_same(x, y)
    else:
        assert a == b


def test_roundtrip_every_engine(ckdir, engine_name):
    g = torch.Generator().manual_seed(1)
    sd = _state(g)
    rec = zerostall.save(ckdir, sd, step=3, io=zerostall.IOConfig(engine=engine_name))
    assert rec.engine == engine_name and rec.ok
    out = zerostall.load(ckdir, io=zerostall.IOConfig(engine=engine_name))
    _assert_same(sd, out)
    assert out["tied_a"] is out["tied_b"]  # stored once, restored shared


def test_load_in_place_keeps_objects(ckdir):
    model = torch.nn.Linear(300, 7)
    zerostall.save(ckdir, {"model": model.state_dict()}, step=1)
    fresh = torch.nn.Linear(300, 7)
    target = {"model": fresh.state_dict()}
    w_before = target["model"]["weight"]
    out = zerostall.load(ckdir, target)
    assert out is target and out["model"]["weight"] is w_before
    assert torch.equal(fresh.weight, model.weight) and torch.equal(fresh.bias, model.bias)


def test_load_shape_mismatch_is_clear(ckdir):
    zerostall.save(ckdir, {"w": torch.zeros(3, 4)}, step=1)
    with pytest.raises(zerostall.errors.ZerostallError, match=r"'w'.*\(4, 3\).*\[3, 4\]"):
        zerostall.load(ckdir, {"w": torch.zeros(4, 3)})


def test_map_location_and_step(ckdir):
    with zerostall.Checkpointer(ckdir) as c:
        c.save(1, {"x": torch.ones(2)}).result()
        c.save(2, {"x": torch.full((2,), 2.0)}).result()
    assert zerostall.load(ckdir, step=1, map_location="cpu")["x"].tolist() == [1.0, 1.0]
    assert zerostall.load(ckdir)["x"].tolist() == [2.0, 2.0]
    with pytest.raises(zerostall.errors.CheckpointNotFound, match="step 5"):
        zerostall.load(ckdir, step=5)


def test_existing_step_needs_overwrite(ckdir):
    zerostall.save(ckdir, {"x": torch.ones(1)}, step=1)
    with pytest.raises(zerostall.errors.CheckpointExistsError, match="overwrite=True"):
        zerostall.save(ckdir, {"x": torch.zeros(1)}, step=1)
    zerostall.save(ckdir, {"x": torch.zeros(1)}, step=1, overwrite=True)
    assert zerostall.load(ckdir)["x"].item() == 0.0


def test_path_is_a_file(tmp_path):
    p = tmp_path / "file"
    p.write_text("x")
    with pytest.raises(zerostall.errors.ZerostallError, match="is a file"):
        zerostall.save(str(p), {"x": torch.ones(1)}, step=1)
