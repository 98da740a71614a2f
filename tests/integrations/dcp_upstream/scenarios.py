"""PyTorch's DCP file-system test scenarios, run once per storage pair, on CPU/gloo.

The scenarios mirror the tests in PyTorch's ``test/distributed/checkpoint/`` that exercise
``FileSystemWriter``/``FileSystemReader`` (``test_file_system_checkpoint_cpu.py``,
``test_file_system_checkpoint.py``, ``test_dtensor_resharding.py``, ``test_save_load_api.py``,
``test_checkpoint.py``), written here for torch 2.13 on CPU with the storage classes as a
parameter: each runs with DCP's own classes and with ``zerostall.dcp``'s. ``UPSTREAM`` names
the upstream test each scenario stands for. Scenarios that exercise a
FileSystemWriter-only argument (stream extensions) run with DCP's classes only.

Run as one rank of a ``WORLD_SIZE`` job (env as torchrun sets it)::

    python scenarios.py OUT.json TMPDIR

Every rank runs every scenario for both pairs in the same order, then all ranks agree on
the outcome (a failure on any rank fails the scenario); rank 0 writes ``OUT.json``.
"""

from __future__ import annotations

import json
import os
import sys
import traceback
import warnings
from datetime import timedelta
from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed._shard import sharded_tensor
from torch.distributed._shard.sharded_tensor import ShardedTensor
from torch.distributed._shard.sharding_spec import ChunkShardingSpec, EnumerableShardingSpec, ShardMetadata
from torch.distributed.checkpoint.stateful import Stateful

warnings.filterwarnings("ignore")

import zerostall.dcp as zdcp  # noqa: E402

PAIRS: dict[str, tuple[Callable[..., Any], Callable[..., Any]]] = {
    "filesystem": (dcp.FileSystemWriter, dcp.FileSystemReader),
    "zerostall": (zdcp.Writer, zdcp.Reader),
}

SCENARIOS: list[tuple[str, str, Callable[..., None], bool, bool]] = []
"""(name, upstream test, function, runs with zerostall too, single-process)."""


def scenario(upstream: str, *, zerostall: bool = True,
             single: bool = False) -> Callable[[Callable[..., None]], Callable[..., None]]:
    """``single``: an upstream single-process test; every rank runs it alone (``no_dist``) in its own dir."""
    def deco(fn: Callable[..., None]) -> Callable[..., None]:
        SCENARIOS.append((fn.__name__, upstream, fn, zerostall, single))
        return fn
    return deco


class Check(Exception):
    pass


def check(cond: Any, msg: str = "") -> None:
    if not cond:
        raise Check(msg or "check failed")


def rank() -> int:
    return dist.get_rank()


def world() -> int:
    return dist.get_world_size()


# -- models and helpers ------------------------------------------------------------------------
class TestModule(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear_1 = torch.nn.Linear(5, 5)
        self.linear_2 = torch.nn.Linear(5, 1)
        self.emb = torch.nn.EmbeddingBag(5, 10)


class ShardedModel(torch.nn.Module):
    def __init__(self, spec: Any, *size: int) -> None:
        super().__init__()
        self.sharded_tensor = sharded_tensor.rand(spec, *(size or (10, 20)), init_rrefs=False)


class Blob(Stateful):
    def __init__(self, value: bytes) -> None:
        self.state = {"blob": value}

    def state_dict(self) -> dict[str, Any]:
        return self.state

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.state = state_dict


def sharded_state_dict(model: torch.nn.Module) -> dict[str, Any]:
    from torch.distributed._shard.sharded_tensor import state_dict_hook
    model._register_state_dict_hook(state_dict_hook)
    return model.state_dict()


def gather(t: ShardedTensor) -> torch.Tensor:
    """The full tensor on every rank."""
    out = torch.zeros(t.shape) if rank() == 0 else None
    t.gather(out=out)
    objs = [out]
    dist.broadcast_object_list(objs, src=0)
    return objs[0]


def equal_sd(a: dict[str, Any], b: dict[str, Any]) -> bool:
    if a.keys() != b.keys():
        return False
    for k, v in a.items():
        w = b[k]
        if isinstance(v, ShardedTensor):
            if not all(torch.equal(x.tensor, y.tensor) for x, y in zip(v.local_shards(), w.local_shards())):
                return False
        elif isinstance(v, torch.Tensor):
            if not torch.equal(v, w):
                return False
        elif v != w:
            return False
    return True


def specs_2d() -> list[Any]:
    return [
        ChunkShardingSpec(dim=0, placements=["rank:0", "rank:1"]),
        ChunkShardingSpec(dim=0, placements=["rank:0", "rank:1", "rank:1", "rank:0"]),
        EnumerableShardingSpec(shards=[
            ShardMetadata(shard_offsets=[0, 0], shard_sizes=[2, 20], placement="rank:0"),
            ShardMetadata(shard_offsets=[2, 0], shard_sizes=[1, 20], placement="rank:1"),
            ShardMetadata(shard_offsets=[3, 0], shard_sizes=[3, 20], placement="rank:0"),
            ShardMetadata(shard_offsets=[6, 0], shard_sizes=[3, 20], placement="rank:1"),
            ShardMetadata(shard_offsets=[9, 0], shard_sizes=[1, 20], placement="rank:0"),
        ]),
        EnumerableShardingSpec(shards=[
            ShardMetadata(shard_offsets=[0, 0], shard_sizes=[8, 20], placement="rank:1"),
            ShardMetadata(shard_offsets=[8, 0], shard_sizes=[2, 20], placement="rank:0"),
        ]),
    ]


# -- test_file_system_checkpoint_cpu.py / test_file_system_checkpoint.py -------------------------
@scenario("TestDistributedStateDictSaveLoad.test_read_write_only_tensor (thread_count 1, 2)", single=True)
def read_write_only_tensor(path: str, W: Any, R: Any) -> None:
    for threads in (1, 2):
        p = f"{path}-{threads}"
        saved = TestModule().state_dict()
        dcp.save_state_dict(state_dict=saved, storage_writer=W(p, thread_count=threads), no_dist=True)
        loaded = TestModule().state_dict()
        check(not equal_sd(loaded, saved), "fresh module equals the saved one")
        dcp.load_state_dict(state_dict=loaded, storage_reader=R(p), no_dist=True)
        check(equal_sd(loaded, saved), "loaded state differs")


@scenario("TestDistributedStateDictSaveLoadRot13.test_read_write_tensor_and_blob (without the extension)",
          single=True)
def read_write_tensor_and_blob(path: str, W: Any, R: Any) -> None:
    saved = TestModule().state_dict()
    saved["test_blob"] = Blob(b"SomeBlobForTesting")
    dcp.save(state_dict=saved, storage_writer=W(path), no_dist=True)
    loaded = TestModule().state_dict()
    loaded["test_blob"] = Blob(b"")
    dcp.load(state_dict=loaded, storage_reader=R(path), no_dist=True)
    check(loaded["test_blob"].state == {"blob": b"SomeBlobForTesting"}, "blob not restored")
    check(all(torch.equal(loaded[k], saved[k]) for k in saved if k != "test_blob"), "tensors differ")


@scenario("TestDistributedStateDictSaveLoadRot13.test_read_write_tensor_and_blob (_extensions=[Rot13Example()])",
          zerostall=False, single=True)
def read_write_rot13_extension(path: str, W: Any, R: Any) -> None:
    from torch.testing._internal.distributed.checkpoint_utils import Rot13Example, get_test_extension_registry
    saved = {"w": torch.randn(4, 4), "blob": Blob(b"abc")}
    dcp.save(saved, storage_writer=W(path, _extensions=[Rot13Example()]), no_dist=True)
    loaded = {"w": torch.zeros(4, 4), "blob": Blob(b"")}
    dcp.load(loaded, storage_reader=R(path, _extension_registry=get_test_extension_registry()), no_dist=True)
    check(torch.equal(loaded["w"], saved["w"]) and loaded["blob"].state == {"blob": b"abc"})


@scenario("TestDistributedStateDictSaveLoadZStandard.test_read_write_only_tensor (_extensions=[ZStandard()])",
          zerostall=False, single=True)
def read_write_zstandard_extension(path: str, W: Any, R: Any) -> None:
    from torch.distributed.checkpoint._extension import ZStandard
    saved = {"w": torch.randn(4, 4)}
    dcp.save(saved, storage_writer=W(path, _extensions=[ZStandard()]), no_dist=True)
    loaded = {"w": torch.zeros(4, 4)}
    dcp.load(loaded, storage_reader=R(path), no_dist=True)
    check(torch.equal(loaded["w"], saved["w"]))


@scenario("TestDistributedStateDictSaveLoadWithSharedTensor.test_read_write_shard_tensor")
def read_write_shard_tensor(path: str, W: Any, R: Any) -> None:
    spec = ChunkShardingSpec(dim=0, placements=["rank:0", "rank:1"])
    saved = sharded_state_dict(ShardedModel(spec))
    dcp.save_state_dict(state_dict=saved, storage_writer=W(path))
    dist.barrier()
    loaded = sharded_state_dict(ShardedModel(spec))
    dcp.load_state_dict(state_dict=loaded, storage_reader=R(path))
    check(equal_sd(loaded, saved), "sharded tensor differs")


@scenario("TestDistributedReshardOnLoad.test_load_with_different_shard_plan")
def load_with_different_shard_plan(path: str, W: Any, R: Any) -> None:
    specs = specs_2d()
    for i, s0 in enumerate(specs):
        for j, s1 in enumerate(specs):
            if i == j:
                continue
            saved = ShardedModel(s0)
            dcp.save_state_dict(state_dict=sharded_state_dict(saved), storage_writer=W(path))
            dist.barrier()
            loaded = ShardedModel(s1)
            dcp.load_state_dict(state_dict=sharded_state_dict(loaded), storage_reader=R(path))
            check(torch.allclose(gather(saved.sharded_tensor), gather(loaded.sharded_tensor)), f"spec {i} -> {j}")


@scenario("TestDistributedReshardOnLoad.test_load_rowwise_to_colwise (on CPU)")
def load_rowwise_to_colwise(path: str, W: Any, R: Any) -> None:
    saved = ShardedModel(ChunkShardingSpec(dim=0, placements=["rank:0", "rank:1"]))
    dcp.save_state_dict(state_dict=sharded_state_dict(saved), storage_writer=W(path))
    loaded = ShardedModel(ChunkShardingSpec(dim=1, placements=["rank:0", "rank:1"]))
    dcp.load_state_dict(state_dict=sharded_state_dict(loaded), storage_reader=R(path))
    check(torch.allclose(gather(saved.sharded_tensor), gather(loaded.sharded_tensor)))


@scenario("TestDistributedReshardOnLoad.test_save_load_bytes")
def save_load_bytes(path: str, W: Any, R: Any) -> None:
    dcp.save_state_dict(state_dict={"bytes0": [1], "bytes1": "string"}, storage_writer=W(path))
    loaded = {"bytes0": [2], "bytes1": "other"}
    dcp.load_state_dict(state_dict=loaded, storage_reader=R(path))
    check(loaded == {"bytes0": [1], "bytes1": "string"}, repr(loaded))


@scenario("TestDistributedReshardOnLoad.test_switch_between_sharded_tensor_to_tensor")
def switch_between_sharded_tensor_to_tensor(path: str, W: Any, R: Any) -> None:
    n = 32
    specs = [
        ChunkShardingSpec(dim=0, placements=["rank:0", "rank:1"]),
        ChunkShardingSpec(dim=0, placements=["rank:0", "rank:1", "rank:1", "rank:0"]),
        EnumerableShardingSpec(shards=[ShardMetadata(shard_offsets=[0], shard_sizes=[8], placement="rank:1"),
                                       ShardMetadata(shard_offsets=[8], shard_sizes=[n - 8], placement="rank:0")]),
        EnumerableShardingSpec(shards=[ShardMetadata(shard_offsets=[0], shard_sizes=[10], placement="rank:0"),
                                       ShardMetadata(shard_offsets=[10], shard_sizes=[n - 10], placement="rank:1")]),
    ]
    for save_spec in specs:
        for load_spec in specs:
            save = {"sharded": sharded_tensor.rand(save_spec, n), "replicated": torch.rand(n)}
            dist.broadcast(save["replicated"], src=0)
            dcp.save_state_dict(state_dict=save, storage_writer=W(path))
            load = {"sharded": torch.zeros(n), "replicated": sharded_tensor.zeros(load_spec, n)}
            dcp.load_state_dict(state_dict=load, storage_reader=R(path))
            check(torch.allclose(gather(save["sharded"]), load["sharded"]), "sharded -> tensor")
            check(torch.allclose(save["replicated"], gather(load["replicated"])), "tensor -> sharded")


# -- test_dtensor_resharding.py ----------------------------------------------------------------
def _dt(placements: list[Any], full: torch.Tensor, mesh_shape: tuple[int, ...] | None = None) -> Any:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import distribute_tensor
    mesh = init_device_mesh("cpu", mesh_shape or (world(),))
    return distribute_tensor(full, mesh, placements)


@scenario("TestDTensorReshardPlacementChange.test_1d_to_1d_reshard_placement_change")
def dtensor_1d_reshard_placement_change(path: str, W: Any, R: Any) -> None:
    from torch.distributed.tensor import Replicate, Shard
    full = torch.arange(64, dtype=torch.float32).reshape(8, 8)
    placements = [[Shard(0)], [Shard(1)], [Replicate()]]
    for i, src in enumerate(placements):
        for j, dst in enumerate(placements):
            dcp.save({"dt": _dt(src, full)}, storage_writer=W(f"{path}-{i}-{j}"))
            sd = {"dt": _dt(dst, torch.zeros(8, 8))}
            dcp.load(sd, storage_reader=R(f"{path}-{i}-{j}"))
            check(torch.equal(sd["dt"].full_tensor(), full), f"{src} -> {dst}")


@scenario("TestDTensorReshardMeshChange.test_1d_to_2d_reshard_mesh_change")
def dtensor_1d_to_2d_mesh(path: str, W: Any, R: Any) -> None:
    from torch.distributed.tensor import Replicate, Shard
    full = torch.arange(96, dtype=torch.float32).reshape(12, 8)
    dcp.save({"dt": _dt([Shard(0)], full)}, storage_writer=W(path))
    for dst in ([Shard(0), Shard(1)], [Replicate(), Shard(0)], [Shard(1), Replicate()]):
        sd = {"dt": _dt(dst, torch.zeros(12, 8), (world(), 1))}
        dcp.load(sd, storage_reader=R(path))
        check(torch.equal(sd["dt"].full_tensor(), full), f"-> {dst}")


@scenario("TestDTensorReshardMeshChange.test_2d_to_1d_reshard_mesh_change")
def dtensor_2d_to_1d_mesh(path: str, W: Any, R: Any) -> None:
    from torch.distributed.tensor import Shard
    full = torch.arange(96, dtype=torch.float32).reshape(12, 8)
    dcp.save({"dt": _dt([Shard(0), Shard(1)], full, (1, world()))}, storage_writer=W(path))
    sd = {"dt": _dt([Shard(1)], torch.zeros(12, 8))}
    dcp.load(sd, storage_reader=R(path))
    check(torch.equal(sd["dt"].full_tensor(), full))


@scenario("TestDTensorReshardMeshChange.test_dtensor_checkpoint_resharding_with_empty_shard")
def dtensor_empty_shard(path: str, W: Any, R: Any) -> None:
    from torch.distributed.tensor import Shard
    full = torch.arange(1, dtype=torch.float32)  # one element over two ranks: one shard is empty
    dcp.save({"dt": _dt([Shard(0)], full)}, storage_writer=W(path))
    sd = {"dt": torch.zeros(1)}
    dcp.load(sd, storage_reader=R(path))
    check(torch.equal(sd["dt"], full))


@scenario("TestDTensorReshardMeshChange.test_dtensor_checkpoint_with_uneven_shards")
def dtensor_uneven_shards(path: str, W: Any, R: Any) -> None:
    from torch.distributed.tensor import Shard
    full = torch.arange(7 * 3, dtype=torch.float32).reshape(7, 3)
    dcp.save({"dt": _dt([Shard(0)], full)}, storage_writer=W(path))
    sd = {"dt": _dt([Shard(1)], torch.zeros(7, 3))}
    dcp.load(sd, storage_reader=R(path))
    check(torch.equal(sd["dt"].full_tensor(), full))


# -- test_save_load_api.py / test_checkpoint.py / state_dict helpers -------------------------
@scenario("TestSaveAndLoadAPI.test_auto_detect (checkpoint_id= with an explicit storage class)")
def checkpoint_id_argument(path: str, W: Any, R: Any) -> None:
    sd = {"w": torch.full((4,), float(rank()))}
    dist.broadcast(sd["w"], src=0)
    dcp.save(sd, checkpoint_id=path + "-b", storage_writer=W(path + "-a"))
    check(os.path.exists(os.path.join(path + "-b", ".metadata")) and not os.path.exists(path + "-a/.metadata"))
    out = {"w": torch.ones(4)}
    dcp.load(out, checkpoint_id=path + "-b", storage_reader=R(path + "-a"))
    check(torch.equal(out["w"], torch.zeros(4)))


@scenario("test_checkpoint.py: storage_meta recorded (checkpoint_id, save_id, load_id)")
def storage_meta_recorded(path: str, W: Any, R: Any) -> None:
    w = W(path)
    dcp.save({"x": torch.ones(2)}, storage_writer=w)
    md = R(path).read_metadata()
    check(md.storage_meta is not None, "storage_meta is None")
    check(os.fspath(md.storage_meta.checkpoint_id) == os.fspath(path), repr(md.storage_meta))
    ids = [None] * world()
    dist.all_gather_object(ids, w.save_id)  # each rank's writer draws one; the coordinator's is recorded
    check(md.storage_meta.save_id == ids[0] and md.storage_meta.load_id, repr(md.storage_meta))


@scenario("FileSystemWriter(overwrite=True) default: a second save replaces the first")
def overwrite_default(path: str, W: Any, R: Any) -> None:
    dcp.save({"x": torch.zeros(3)}, storage_writer=W(path))
    dcp.save({"x": torch.ones(3)}, storage_writer=W(path))
    out = {"x": torch.full((3,), 7.0)}
    dcp.load(out, storage_reader=R(path))
    check(torch.equal(out["x"], torch.ones(3)))


@scenario("FileSystemWriter(overwrite=False): refuses an existing checkpoint, accepts other files")
def overwrite_false(path: str, W: Any, R: Any) -> None:
    if rank() == 0:
        os.makedirs(path, exist_ok=True)
        open(os.path.join(path, "notes.txt"), "w").write("mine")
    dist.barrier()
    dcp.save({"x": torch.zeros(3)}, storage_writer=W(path, overwrite=False))
    try:
        dcp.save({"x": torch.ones(3)}, storage_writer=W(path, overwrite=False))
    except BaseException as exc:  # noqa: BLE001 - DCP wraps it in CheckpointException
        check("Checkpoint already exists" in str(exc), str(exc)[-300:])
    else:
        raise Check("second save with overwrite=False did not raise")
    out = {"x": torch.full((3,), 7.0)}
    dcp.load(out, storage_reader=R(path))
    check(torch.equal(out["x"], torch.zeros(3)) and open(os.path.join(path, "notes.txt")).read() == "mine")


@scenario("dcp.async_save (test_save_load_api / test_async_process_executor's save path)")
def async_save(path: str, W: Any, R: Any) -> None:
    sd = {"w": torch.randn(100, 3), "n": {"step": 5}}
    dist.broadcast(sd["w"], src=0)
    fut = dcp.async_save(sd, storage_writer=W(path))
    (getattr(fut, "upload_completion", None) or fut).result()
    out = {"w": torch.zeros(100, 3), "n": {"step": 0}}
    dcp.load(out, storage_reader=R(path))
    check(torch.equal(out["w"], sd["w"]) and out["n"]["step"] == 5)


@scenario("use_collectives=False (rank-local metadata, state_dict_saver's no-coordination path)")
def no_collectives(path: str, W: Any, R: Any) -> None:
    sd = {"x": torch.full((5,), float(rank())), "mine": torch.arange(3) + 10 * rank()}
    dcp.save(sd, storage_writer=W(path), use_collectives=False)
    dist.barrier()
    names = os.listdir(path)
    check({f"__{r}.metadata" for r in range(world())} <= set(names), repr(names))
    if W is zdcp.Writer:  # each rank its own storage index: never two ranks writing one file
        check(sorted(n[:10] for n in names if n.endswith(".shard")) == [f"rank-{r:05d}" for r in range(world())],
              repr(names))
    out = {"x": torch.zeros(5), "mine": torch.zeros(3, dtype=torch.int64)}
    dcp.load(out, storage_reader=R(path))
    check(torch.equal(out["x"], sd["x"]) and torch.equal(out["mine"], sd["mine"]), f"rank {rank()} got {out}")


def _step(m: TestModule, opt: torch.optim.Optimizer) -> None:
    x = m.linear_2(m.linear_1(torch.randn(3, 5))).sum() + m.emb(torch.tensor([[0, 1]])).sum()
    x.backward()
    opt.step()


@scenario("test_state_dict.py: get_state_dict / set_state_dict of a model and AdamW through DCP")
def model_and_optimizer(path: str, W: Any, R: Any) -> None:
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
    torch.manual_seed(0)
    m = TestModule()
    opt = torch.optim.AdamW(m.parameters(), lr=0.1)
    _step(m, opt)
    msd, osd = get_state_dict(m, opt)
    dcp.save({"model": msd, "optim": osd}, storage_writer=W(path))
    torch.manual_seed(1)
    m2 = TestModule()
    opt2 = torch.optim.AdamW(m2.parameters(), lr=0.1)
    _step(m2, opt2)
    msd2, osd2 = get_state_dict(m2, opt2)
    sd2 = {"model": msd2, "optim": osd2}
    dcp.load(sd2, storage_reader=R(path))
    set_state_dict(m2, opt2, model_state_dict=sd2["model"], optim_state_dict=sd2["optim"])
    check(all(torch.equal(a, b) for a, b in zip(m.state_dict().values(), m2.state_dict().values())), "model")
    s1, s2 = opt.state_dict()["state"], opt2.state_dict()["state"]
    check(all(torch.equal(s1[k]["exp_avg"], s2[k]["exp_avg"]) for k in s1), "optimizer")


@scenario("dtypes, scalars, empty and non-contiguous tensors, nested containers")
def dtypes_and_layouts(path: str, W: Any, R: Any) -> None:
    base = torch.arange(24, dtype=torch.float32).reshape(4, 6)
    sd = {"bf16": base.to(torch.bfloat16), "i8": base.to(torch.int8), "bool": base > 5, "f64": base.double(),
          "scalar": torch.tensor(3.5), "empty": torch.empty(0, 4), "t": base.t(), "nested": {"l": [base + 1, 7]},
          "c64": torch.complex(base, -base)}
    dcp.save(sd, storage_writer=W(path))
    out = {k: (torch.zeros_like(v) if isinstance(v, torch.Tensor) else v) for k, v in sd.items()}
    out["t"] = torch.zeros(6, 4)
    out["nested"] = {"l": [torch.zeros(4, 6), 0]}
    dcp.load(out, storage_reader=R(path))
    for k in ("bf16", "i8", "bool", "f64", "scalar", "empty", "t", "c64"):
        check(torch.equal(out[k], sd[k]), k)
    check(torch.equal(out["nested"]["l"][0], base + 1) and out["nested"]["l"][1] == 7, "nested")


@scenario("DefaultLoadPlanner: a key missing from the checkpoint is an error")
def missing_key_is_error(path: str, W: Any, R: Any) -> None:
    dcp.save({"a": torch.ones(2)}, storage_writer=W(path))
    try:
        dcp.load({"a": torch.zeros(2), "b": torch.zeros(2)}, storage_reader=R(path))
    except BaseException as exc:  # noqa: BLE001
        check("b" in str(exc), str(exc)[-200:])
    else:
        raise Check("loading a missing key did not raise")


@scenario("_load_state_dict_from_keys / format_utils: read a checkpoint without a template")
def load_without_template(path: str, W: Any, R: Any) -> None:
    from torch.distributed.checkpoint.state_dict_loader import _load_state_dict_from_keys
    sd = {"a": torch.arange(6.0).reshape(2, 3), "b": {"c": torch.ones(2)}, "s": "text"}
    dcp.save(sd, storage_writer=W(path))
    dist.barrier()
    got = _load_state_dict_from_keys(storage_reader=R(path), process_group=None)
    check(torch.equal(got["a"], sd["a"]) and torch.equal(got["b"]["c"], sd["b"]["c"]) and got["s"] == "text",
          repr(got)[:200])


@scenario("DefaultLoadPlanner(allow_partial_load=True): load a subset of the saved keys")
def partial_load(path: str, W: Any, R: Any) -> None:
    from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
    dcp.save({"a": torch.arange(4.0), "b": torch.ones(3), "c": {"x": 1}}, storage_writer=W(path))
    out = {"b": torch.zeros(3), "extra": torch.full((2,), 9.0)}
    dcp.load(out, storage_reader=R(path), planner=DefaultLoadPlanner(allow_partial_load=True))
    check(torch.equal(out["b"], torch.ones(3)) and torch.equal(out["extra"], torch.full((2,), 9.0)))


@scenario("test_fsdp_dsd.py (CPU): FSDP2 fully_shard model saved, loaded into an unsharded model")
def fsdp2_to_full(path: str, W: Any, R: Any) -> None:
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    torch.manual_seed(0)
    m = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
    ref = {k: v.clone() for k, v in m.state_dict().items()}
    fully_shard(m, mesh=init_device_mesh("cpu", (world(),)))
    dcp.save(get_model_state_dict(m), storage_writer=W(path))
    plain = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
    sd = get_model_state_dict(plain, options=StateDictOptions(full_state_dict=False))
    dcp.load(sd, storage_reader=R(path))
    check(all(torch.equal(sd[k], ref[k]) for k in ref), "parameters differ")


# -- the runner ----------------------------------------------------------------------------------
def run(out: str, tmp: str, only: list[str] | None = None) -> None:
    dist.init_process_group("gloo", timeout=timedelta(seconds=60))
    results = []
    for name, upstream, fn, with_zs, single in SCENARIOS:
        if only and name not in only:
            continue
        for impl, (W, R) in PAIRS.items():
            if impl == "zerostall" and not with_zs:
                results.append({"scenario": name, "upstream": upstream, "impl": impl, "outcome": "n/a",
                                "error": "exercises a FileSystemWriter-only argument (stream extensions)"})
                continue
            path = os.path.join(tmp, impl, name) + (f"-rank{rank()}" if single else "")
            err = ""
            try:
                fn(path, W, R)
            except BaseException as exc:  # noqa: BLE001 - recorded
                err = f"{type(exc).__name__}: {exc}"[-600:] + "\n" + traceback.format_exc()[-1500:]
            errs = [None] * world()
            dist.all_gather_object(errs, err)
            bad = [e for e in errs if e]
            results.append({"scenario": name, "upstream": upstream, "impl": impl,
                            "outcome": "fail" if bad else "pass", "error": bad[0] if bad else ""})
            dist.barrier()
    if rank() == 0:
        with open(out, "w") as f:
            json.dump(results, f, indent=1)
    dist.barrier()
    dist.destroy_process_group()
    sys.stdout.flush()
    os._exit(0)  # skip interpreter teardown (gloo threads); results are written


if __name__ == "__main__":
    run(sys.argv[1], sys.argv[2], sys.argv[3].split(",") if len(sys.argv) > 3 else None)
