"""Common Python objects through a real save/load: what comes back, and what never runs."""

import argparse
import dataclasses
import datetime as dt
import enum
import json
import os
import pathlib
import sys
import uuid

import pytest
import torch

import zerostall
from zerostall.errors import CorruptCheckpoint, UnsupportedStateError
from zerostall.format.objects import TaggedData, unregister_type
from zerostall.format.decode import decode_tree
from zerostall.format.tree import encode_tree


class Color(enum.Enum):
    RED = "red"
    BLUE = "blue"


class Level(enum.IntEnum):
    LOW = 1
    HIGH = 2


@dataclasses.dataclass
class Cfg:
    lr: float = 1e-3
    name: str = "x"
    scale: torch.Tensor | None = None
    tags: list = dataclasses.field(default_factory=list)
    derived: int = dataclasses.field(init=False, default=0)

    def __post_init__(self):
        self.derived = len(self.name)


@dataclasses.dataclass(frozen=True)
class Frozen:
    a: int
    b: tuple = ()


class Plain:
    def __init__(self, x):
        self.x = x


@pytest.fixture
def registered():
    for c in (Color, Level, Cfg, Frozen, Plain):
        zerostall.register_type(c)
    yield
    for c in (Color, Level, Cfg, Frozen, Plain):
        unregister_type(c)


STANDARD = {
    "ns": argparse.Namespace(lr=0.1, layers=[1, 2], nested=argparse.Namespace(a=None)),
    "path": pathlib.Path("/data/x.bin"), "ppath": pathlib.PurePosixPath("a/b"),
    "when": dt.datetime(2026, 11, 29, 18, 42, 16, 123456, tzinfo=dt.timezone(dt.timedelta(hours=2))),
    "naive": dt.datetime(2026, 1, 2, 3, 4, 5), "day": dt.date(2026, 11, 29), "clock": dt.time(7, 8, 9),
    "delta": dt.timedelta(days=-1, seconds=5, microseconds=7), "tz": dt.timezone.utc,
    "set": {3, 1, 2}, "fset": frozenset({"a", "b"}), "raw": b"\x00\xffzs", "ba": bytearray(b"ab"),
    "cx": complex(1.5, -2), "id": uuid.UUID(int=12345), "dtype": torch.bfloat16, "dev": torch.device("cpu"),
}


def roundtrip(tmp_path, state, **kw):
    zerostall.save(tmp_path / "ck", state, 1, overwrite=True)
    return zerostall.load(tmp_path / "ck", **kw)


def test_standard_types_roundtrip_exactly(tmp_path):
    out = roundtrip(tmp_path, {"objs": STANDARD, "w": torch.arange(4.)})
    assert out["objs"] == STANDARD
    for k, v in STANDARD.items():
        assert type(out["objs"][k]) is type(v), k
    assert torch.equal(out["w"], torch.arange(4.))


def test_registered_types_are_rebuilt(tmp_path, registered):
    cfg = Cfg(lr=0.5, name="abcd", scale=torch.tensor([2.0, 3.0]), tags=[Color.BLUE])
    state = {"cfg": cfg, "frozen": Frozen(1, (2, 3)), "color": Color.RED, "lvl": Level.HIGH,
             "plain": Plain({"k": 1}), "cls": Cfg}
    out = roundtrip(tmp_path, state)
    c = out["cfg"]
    assert type(c) is Cfg and c.lr == 0.5 and c.name == "abcd" and c.derived == 4 and c.tags == [Color.BLUE]
    assert torch.equal(c.scale, torch.tensor([2.0, 3.0]))
    assert out["frozen"] == Frozen(1, (2, 3))
    assert out["color"] is Color.RED and out["lvl"] is Level.HIGH
    assert type(out["plain"]) is Plain and out["plain"].x == {"k": 1}
    assert out["cls"] is Cfg


def test_unregistered_types_come_back_as_tagged_data(tmp_path, registered):
    state = {"cfg": Cfg(name="ab"), "color": Color.BLUE, "cls": Cfg, "optcls": torch.optim.AdamW}
    zerostall.save(tmp_path / "ck", state, 1)
    for c in (Color, Cfg):
        unregister_type(c)
    out = zerostall.load(tmp_path / "ck")
    name = f"{__name__}.Cfg"
    assert out["cfg"] == TaggedData(name, {"lr": 1e-3, "name": "ab", "scale": None, "tags": [], "derived": 2})
    assert out["color"] == TaggedData(f"{__name__}.Color", {"name": "BLUE", "value": "blue"})
    assert out["cls"] == TaggedData("class", name)
    assert out["optcls"] == TaggedData("class", "torch.optim.adamw.AdamW")
    # saving the tagged data again writes the same nodes: registering later still works
    zerostall.save(tmp_path / "ck2", out, 1)
    zerostall.register_type(Cfg)
    again = zerostall.load(tmp_path / "ck2")
    assert type(again["cfg"]) is Cfg and again["cfg"].name == "ab"
    assert again["cls"] is Cfg


def test_decoding_never_imports_or_calls(tmp_path):
    """A hostile tree naming modules and callables: nothing is imported, nothing runs."""
    target = tmp_path / "pwned"
    names = ["os.system", "subprocess.Popen", "zs_hostile_module_never_imported.Thing", "builtins.eval"]
    nodes = [{"o": [n, {"l": [{"v": f"touch {target}"}]}]} for n in names]
    nodes += [{"o": ["class", {"v": "zs_hostile_module_never_imported.Thing"}]},
              {"o": ["argparse.Namespace", {"d": [[{"v": "__class__"}, {"v": "x"}]]}]}]
    before = set(sys.modules)
    out = decode_tree({"l": nodes[:-1]}, [])
    assert [o.type for o in out] == names + ["class"]
    assert all(isinstance(o, TaggedData) for o in out)
    assert "zs_hostile_module_never_imported" not in sys.modules
    assert set(sys.modules) - before == set()
    assert not target.exists()
    with pytest.raises(CorruptCheckpoint, match="argparse.Namespace"):
        decode_tree(nodes[-1], [])


@pytest.mark.parametrize("node,match", [
    ({"o": "x"}, "object node"),
    ({"o": ["bytes", {"v": "not base64!"}]}, "bytes"),
    ({"o": ["torch.dtype", {"v": "nn"}]}, "torch dtype"),
    ({"o": ["datetime.timedelta", {"v": 1}]}, "timedelta"),
    ({"o": ["torch.device", {"v": "bogus:0"}]}, "torch.device"),
    ({"o": ["complex", {"d": [[{"v": "x"}, {"v": 1}]]}]}, "complex"),
    ({"o": ["datetime.timedelta", {"d": [[{"v": "x"}, {"v": 1}]]}]}, "timedelta"),
    ({"o": ["complex", {"T": 0}]}, "complex"),
    ({"o": ["torch.device", {"v": "cuda:-5"}]}, "torch.device"),
    ({"o": ["omegaconf.DictConfig", {"v": "a: ["}]}, "DictConfig"),
    ({"o": ["omegaconf.DictConfig", {"v": "a: !!python/object/apply:os.system [x]"}]}, "DictConfig"),
    ({"o": ["omegaconf.ListConfig", {"j": {"a": 1}}]}, "ListConfig"),
    ({"o": ["omegaconf.DictConfig", {"j": {"b": "${zz"}}]}, "DictConfig"),
])
def test_malformed_object_nodes_are_corrupt(node, match):
    with pytest.raises(CorruptCheckpoint, match=match):
        decode_tree(node, [torch.zeros(2)])


def test_dtype_names_import_nothing():
    """torch.dtype payloads are looked up, never fetched through torch's lazy submodule imports."""
    before = set(sys.modules)
    for name in ("_inductor", "_dynamo", "onnx"):
        with pytest.raises(CorruptCheckpoint, match="torch dtype"):
            decode_tree({"o": ["torch.dtype", {"v": name}]}, [])
    assert {m for m in set(sys.modules) - before if m.startswith("torch")} == set()


def test_a_path_of_the_other_os_loads_as_its_pure_flavour():
    other = "WindowsPath" if os.name != "nt" else "PosixPath"
    out = decode_tree({"o": [f"pathlib.{other}", {"v": "a/b"}]}, [])
    assert isinstance(out, pathlib.PurePath) and str(out).replace("\\", "/") == "a/b"


def test_a_manifest_with_objects_validates_without_building(tmp_path, registered):
    calls = []

    @dataclasses.dataclass
    class Spy:
        a: int

        def __post_init__(self):
            calls.append(self.a)

    zerostall.register_type(Spy)
    try:
        zerostall.save(tmp_path / "ck", {"spy": Spy(1)}, 1)
        calls.clear()
        zerostall.load(tmp_path / "ck")
        assert calls == [1]  # built once for the result, never for validation
    finally:
        unregister_type(Spy)


def test_register_type_rejects_reserved_and_clashing_names():
    with pytest.raises(zerostall.errors.ConfigError, match="reserved"):
        zerostall.register_type(Plain, name="set")
    zerostall.register_type(Plain, name="tests.Plain")
    try:
        with pytest.raises(zerostall.errors.ConfigError, match="already registered"):
            zerostall.register_type(Frozen, name="tests.Plain")
    finally:
        unregister_type(Plain)


def test_omegaconf_configs(tmp_path):
    omegaconf = pytest.importorskip("omegaconf")
    cfg = omegaconf.OmegaConf.create({"model": {"dim": 8, "ref": "${model.dim}"}, "layers": [1, 2]})
    out = roundtrip(tmp_path, {"cfg": cfg, "lst": cfg.layers})
    assert isinstance(out["cfg"], omegaconf.DictConfig) and isinstance(out["lst"], omegaconf.ListConfig)
    assert out["cfg"].model.ref == 8  # the interpolation survives, unresolved
    assert omegaconf.OmegaConf.to_container(out["cfg"]) == omegaconf.OmegaConf.to_container(cfg)


def test_stateful_objects_are_saved_and_loaded_in_place(tmp_path):
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 3)
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    sched = torch.optim.lr_scheduler.StepLR(opt, 1, gamma=0.5)
    model(torch.randn(2, 4)).sum().backward()
    opt.step()
    sched.step()
    want = {k: v.clone() for k, v in model.state_dict().items()}
    zerostall.save(tmp_path / "ck", {"model": model, "opt": opt, "sched": sched, "extra": {"step": 7}}, 1)
    # the stored tree is plain state dicts
    plain = zerostall.load(tmp_path / "ck")
    assert set(plain["model"]) == {"weight", "bias"} and "state" in plain["opt"]
    model2 = torch.nn.Linear(4, 3)
    opt2 = torch.optim.AdamW(model2.parameters(), lr=0.01)
    sched2 = torch.optim.lr_scheduler.StepLR(opt2, 1, gamma=0.5)
    state = {"model": model2, "opt": opt2, "sched": sched2, "extra": {}}
    assert zerostall.load(tmp_path / "ck", state) is state
    assert state["model"] is model2 and state["extra"] == {"step": 7}
    assert all(torch.equal(model2.state_dict()[k], v) for k, v in want.items())
    assert opt2.param_groups[0]["lr"] == opt.param_groups[0]["lr"] == 0.005
    assert torch.equal(opt2.state_dict()["state"][0]["exp_avg"], opt.state_dict()["state"][0]["exp_avg"])
    assert sched2.last_epoch == 1


def test_rng_state_roundtrip_resumes_the_same_draws(tmp_path):
    import random

    import numpy as np
    zerostall.save(tmp_path / "ck", {"rng": zerostall.rng_state()}, 1)
    want = (random.random(), np.random.rand(), torch.rand(3))
    random.seed(99), np.random.seed(99), torch.manual_seed(99)
    zerostall.set_rng_state(zerostall.load(tmp_path / "ck")["rng"])
    got = (random.random(), np.random.rand(), torch.rand(3))
    assert got[:2] == want[:2] and torch.equal(got[2], want[2])
    with pytest.raises(zerostall.errors.ConfigError, match="unknown generator"):
        zerostall.set_rng_state({"jax": 1})


def test_unsupported_objects_still_name_the_key():
    with pytest.raises(UnsupportedStateError, match=r"'a\.b'.*register_type"):
        encode_tree({"a": {"b": object()}})


def test_manifest_stays_json(tmp_path, registered):
    zerostall.save(tmp_path / "ck", {"cfg": Cfg(), "ns": argparse.Namespace(a=1)}, 3)
    body = json.load(open(os.path.join(tmp_path, "ck", "step-3", "manifest.json")))["body"]
    assert "Namespace" in json.dumps(body["tree"])


@pytest.mark.gpu
def test_rng_state_covers_every_cuda_device(tmp_path):
    state = zerostall.rng_state()
    assert len(state["cuda"]) == torch.cuda.device_count()
    zerostall.save(tmp_path / "ck", {"rng": state}, 1)
    want = [torch.rand(3, device=f"cuda:{i}") for i in range(torch.cuda.device_count())]
    torch.cuda.manual_seed_all(99)
    zerostall.set_rng_state(zerostall.load(tmp_path / "ck")["rng"])
    got = [torch.rand(3, device=f"cuda:{i}") for i in range(torch.cuda.device_count())]
    assert all(torch.equal(a, b) for a, b in zip(want, got))


@dataclasses.dataclass
class Width:
    """A script's hyper-parameters class, imported here under this module's name."""

    width: int = 0


_SCRIPT = """
import dataclasses, sys, zerostall

@dataclasses.dataclass
class Width:
    width: int = 0

if sys.argv[1] == "save":
    zerostall.save(sys.argv[2], {"hp": Width(8), "cls": Width}, step=1)
else:  # load what another program saved as {module}.Width, registering __main__.Width
    zerostall.register_type(Width)
    got = zerostall.load(sys.argv[2])
    assert type(got["hp"]) is Width and got["hp"].width == 5 and got["cls"] is Width, got
    print("ok")
"""


def test_a_type_of_a_scripts_main_resolves_by_its_qualified_name(tmp_path):
    """Saved by a script as __main__.Width, loaded where the class is registered from its
    module (and the reverse); unregistered, attribute access names the type and the fix.
    (register_type(Width) did not match __main__.Width: 'TaggedData' object has no attribute 'width'.)"""
    import subprocess
    script = tmp_path / "train.py"
    script.write_text(_SCRIPT)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}
    r = subprocess.run([sys.executable, str(script), "save", str(tmp_path / "a")], env=env, capture_output=True,
                       text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]
    plain = zerostall.load(tmp_path / "a")
    assert plain["hp"] == TaggedData("__main__.Width", {"width": 8})
    with pytest.raises(AttributeError, match=r"'__main__.Width'.*register_type\(Width\)"):
        plain["hp"].width
    zerostall.register_type(Width)
    try:
        got = zerostall.load(tmp_path / "a")
        assert type(got["hp"]) is Width and got["hp"].width == 8 and got["cls"] is Width
        zerostall.save(tmp_path / "b", {"hp": Width(5), "cls": Width}, step=1)  # recorded as <module>.Width
    finally:
        unregister_type(Width)
    r = subprocess.run([sys.executable, str(script), "load", str(tmp_path / "b")], env=env, capture_output=True,
                       text=True, timeout=120)
    assert r.returncode == 0 and r.stdout.strip() == "ok", r.stderr[-2000:]
