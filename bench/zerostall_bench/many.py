"""``zerostall bench --scenario many-tensors``: a state of many small tensors (per-parameter
optimizer state of a large MoE) against ``torch.save``/``torch.load`` and DCP, in one run.

Measures, for ``--tensors`` tensors of ``--size-gib`` in total: zerostall's first save
(blocked time and durable), a reused Checkpointer's steady ``save()`` stall, durable and
``result()`` with ``keep_last=1`` (retention included), bytes on disk and staging memory as a
multiple of the data, restore in place and into a new dict (page cache dropped); torch.save +
fsync and torch.load; dcp.save and dcp.load in place. Each restore is checked bit for bit.
Runs on the caller's thread.
"""

from __future__ import annotations

import os
import shutil
import statistics
import tempfile
import time
from typing import Any

import torch

from zerostall import _term

from .report import write_doc
from .restore import _drop, _equal


def _dir_bytes(root: str) -> int:
    return sum(os.path.getsize(os.path.join(dp, f)) for dp, _, fs in os.walk(root) for f in fs)


def many_state(n: int, total_bytes: int) -> dict[str, dict[str, torch.Tensor]]:
    per = max(1, total_bytes // n // 4)
    g = torch.Generator().manual_seed(0)
    return {"optim": {f"state.{i}.exp_avg": torch.randn(per, generator=g) for i in range(n)}}


def run_many(n: int, size_gib: float, repeat: int, workdir: str | None, console: Any) -> dict[str, Any]:
    from zerostall import Checkpointer
    from zerostall.saving import pool
    own = workdir is None
    workdir = workdir or tempfile.mkdtemp(prefix="zerostall-bench-many-", dir=os.getcwd())
    os.makedirs(workdir, exist_ok=True)
    out: dict[str, Any] = {"scenario": "many-tensors", "tensors": n, "repeat": repeat,
                           "load_avg_start": list(os.getloadavg())}
    try:
        state = many_state(n, int(size_gib * (1 << 30)))
        data = sum(t.numel() * 4 for t in state["optim"].values())
        out["data_bytes"] = data
        target = {"optim": {k: torch.zeros_like(t) for k, t in state["optim"].items()}}
        root = os.path.join(workdir, "zs")
        zs: dict[str, Any] = {}
        with Checkpointer(root, keep_last=1) as ck:
            t0 = time.perf_counter()
            h = ck.save(0, state)
            zs["first_stall_s"] = time.perf_counter() - t0
            h.result()
            zs["first_durable_s"] = time.perf_counter() - t0
            stalls, durables, results = [], [], []
            for r in range(1, repeat + 1):
                t0 = time.perf_counter()
                h = ck.save(r, state)
                stalls.append(time.perf_counter() - t0)
                h.wait()
                durables.append(time.perf_counter() - t0)
                h.result()
                results.append(time.perf_counter() - t0)
            zs.update(stall_s=statistics.median(stalls), durable_s=statistics.median(durables),
                      result_s=statistics.median(results), stall_all_s=stalls)
            zs["disk_bytes_ratio"] = _dir_bytes(os.path.join(root, f"step-{repeat}")) / data
            man = os.path.join(root, f"step-{repeat}", "manifest.json")
            zs["manifest_bytes_ratio"] = os.path.getsize(man) / data  # the rest of disk_bytes: the shard
            p = pool.current()
            zs["staging_bytes_ratio"] = (p.arena.ready / data) if p is not None else None
            for name, sd in (("restore_in_place_s", target), ("restore_new_dict_s", None)):
                _drop(root)
                t0 = time.perf_counter()
                got = ck.load(sd, step=repeat)
                zs[name] = time.perf_counter() - t0
                zs["verified"] = zs.get("verified", True) and _equal(state, got)
                del got
        shutil.rmtree(root, ignore_errors=True)
        console.print(f"  zerostall: {zs}")
        ts: dict[str, Any] = {}
        path = os.path.join(workdir, "state.pt")
        t0 = time.perf_counter()
        with open(path, "wb") as f:
            torch.save(state, f)
            f.flush()
            os.fsync(f.fileno())
        ts["save_s"] = time.perf_counter() - t0
        ts["disk_bytes_ratio"] = os.path.getsize(path) / data
        _drop(workdir)
        t0 = time.perf_counter()
        got = torch.load(path, weights_only=True)
        ts["restore_s"] = time.perf_counter() - t0
        ts["verified"] = _equal(state, got)
        del got
        os.unlink(path)
        console.print(f"  torch.save: {ts}")
        import torch.distributed.checkpoint as dcp
        droot = os.path.join(workdir, "dcp")
        dc: dict[str, Any] = {}
        t0 = time.perf_counter()
        dcp.save(state, storage_writer=dcp.FileSystemWriter(droot), no_dist=True)
        dc["save_s"] = time.perf_counter() - t0
        dc["disk_bytes_ratio"] = _dir_bytes(droot) / data
        for t in target["optim"].values():
            t.zero_()
        _drop(droot)
        t0 = time.perf_counter()
        dcp.load(target, storage_reader=dcp.FileSystemReader(droot), no_dist=True)
        dc["restore_s"] = time.perf_counter() - t0
        dc["verified"] = _equal(state, target)
        shutil.rmtree(droot, ignore_errors=True)
        console.print(f"  dcp: {dc}")
    finally:
        if own:
            shutil.rmtree(workdir, ignore_errors=True)
    out.update(zerostall=zs, torch_save=ts, dcp=dc, load_avg_end=list(os.getloadavg()))
    out["ratios"] = {"steady_stall_vs_torch_save": zs["stall_s"] / ts["save_s"],
                     "first_save_vs_torch_save": zs["first_durable_s"] / ts["save_s"],
                     "restore_vs_torch_load": zs["restore_new_dict_s"] / ts["restore_s"],
                     "result_vs_durable": zs["result_s"] / zs["durable_s"]}
    return out


def main(a: Any) -> int:
    """``zerostall bench --scenario many-tensors``."""
    import warnings

    warnings.filterwarnings("ignore", message=".*assuming the intent is to")
    console = _term.console()
    size = a.size_gib if a.size_gib != 2.0 else 0.25  # the scenario's default: 256 MiB
    doc = run_many(a.tensors, size, a.repeat, a.dir, console)
    zs, ts, dc, r = doc["zerostall"], doc["torch_save"], doc["dcp"], doc["ratios"]
    console.print(f"{doc['tensors']} tensors, {doc['data_bytes'] / 2**20:.0f} MiB: zerostall steady stall "
                  f"{zs['stall_s'] * 1e3:.1f} ms ({r['steady_stall_vs_torch_save']:.3f}x torch.save's "
                  f"{ts['save_s']:.2f} s), first save durable {zs['first_durable_s']:.2f} s "
                  f"({r['first_save_vs_torch_save']:.2f}x), durable {zs['durable_s']:.2f} s, result() "
                  f"{zs['result_s']:.2f} s ({r['result_vs_durable']:.2f}x durable), disk {zs['disk_bytes_ratio']:.2f}x "
                  f"data (torch.save {ts['disk_bytes_ratio']:.2f}x, DCP {dc['disk_bytes_ratio']:.2f}x), staging "
                  f"{zs['staging_bytes_ratio'] or 0:.2f}x; restore new dict {zs['restore_new_dict_s']:.2f} s "
                  f"({r['restore_vs_torch_load']:.2f}x torch.load's {ts['restore_s']:.2f} s), in place "
                  f"{zs['restore_in_place_s']:.2f} s (dcp.load {dc['restore_s']:.2f} s)")
    write_doc(doc, a.json)
    return 0 if zs["verified"] and ts["verified"] and dc["verified"] else 1
