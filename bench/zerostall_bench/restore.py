"""``zerostall bench --scenario restore``: restore GB/s of every method against the disk's read line rate.

One run, one process, page cache dropped before every restore: zerostall in place
(``Checkpointer.load(state)`` through its staging pool, once the pool is faulted; and one-shot
``zerostall.load``, as in a process without a pool: a verify-first second read),
zerostall into a new dict, ``dcp.load`` in place, ``torch.load`` and ``torch.load(mmap=True)``
with every byte touched. Each restore is checked bit for bit. Called by the bench CLI on the
caller's thread; nothing here runs concurrently. ``--device cuda``: the state and the
in-place targets live on the GPU, new dicts load with ``map_location="cuda"`` (zerostall,
``torch.load``), every row ends with ``torch.cuda.synchronize()``; the rows' fraction of the
read line rate is then the CUDA restore's (issue 25's target: >= 0.8).
"""

from __future__ import annotations

import os
import shutil
import statistics
import tempfile
import time
from typing import Any, Callable

import torch

from zerostall import _term
from zerostall.config import IOConfig
from .report import write_doc


def _flat(state: Any) -> list[torch.Tensor]:
    if isinstance(state, torch.Tensor):
        return [state]
    if isinstance(state, dict):
        return [t for v in state.values() for t in _flat(v)]
    return []


def _equal(a: Any, b: Any) -> bool:
    fa, fb = _flat(a), _flat(b)
    return len(fa) == len(fb) and all(x.dtype == y.dtype and x.shape == y.shape and x.device == y.device and
                                      torch.equal(x.view(torch.uint8) if x.dtype != torch.bool else x,
                                                  y.view(torch.uint8) if y.dtype != torch.bool else y)
                                      for x, y in zip(fa, fb))


def _drop(root: str) -> None:
    for dp, _, fs in os.walk(root):
        for f in fs:
            try:
                fd = os.open(os.path.join(dp, f), os.O_RDONLY)
            except OSError:
                continue
            try:
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)


def _touch(state: Any) -> None:
    for t in _flat(state):
        t.view(-1)[:: max(1, 4096 // max(1, t.element_size()))].sum()  # one read per page


def _pool_ready() -> None:
    """Wait until the staging pool has faulted what its users want (on a VM fresh memory
    faults at 0.15-1 GB/s, and a load meanwhile reads the step twice: see restore/step.py)."""
    from zerostall.saving import pool
    p = pool.current()
    if p is not None:
        p.arena.wait_ready(min(p.arena.target, p.arena.nbytes))


def run_restore_bench(size_gib: float, repeat: int, workdir: str | None, engines: list[str] | None,
                      console: Any, line: dict[str, Any] | None = None, device: str = "cpu") -> dict[str, Any]:
    from zerostall import Checkpointer
    from zerostall import load as zs_load
    from .hostinfo import line_rate
    from .model import gpt_state_for_size, settle_gc
    own = workdir is None
    workdir = workdir or tempfile.mkdtemp(prefix="zerostall-bench-restore-", dir=os.getcwd())
    os.makedirs(workdir, exist_ok=True)
    try:
        state = gpt_state_for_size(int(size_gib * (1 << 30)))
        cuda = device != "cpu"
        if cuda:
            state = {k: {n: t.to(device) for n, t in v.items()} for k, v in state.items()}
        to = {"map_location": device} if cuda else {}
        size = sum(t.numel() * t.element_size() for t in _flat(state))
        target = {k: {n: torch.zeros_like(t) for n, t in v.items()} for k, v in state.items()}
        settle_gc()
        if line is None:
            console.print("measuring the disk's read line rate ...")
            line = line_rate(workdir, max(1 << 20, min(size, 2 << 30) >> 20 << 20))  # whole MiB: O_DIRECT
        if engines is None:
            from zerostall.io.probe import io_uring_status
            engines = (["uring"] if io_uring_status()[0] else []) + ["threads"]
        rows: dict[str, list[float]] = {}
        ok: dict[str, bool] = {}

        def timed(name: str, fn: Callable[[], Any], root: str) -> None:
            _drop(root)
            t0 = time.perf_counter()
            out = fn()
            if cuda:
                torch.cuda.synchronize()
            dt = time.perf_counter() - t0
            good = _equal(state, out)
            rows.setdefault(name, []).append(dt)
            ok[name] = ok.get(name, True) and good
            console.print(f"  {name}: {size / dt / 1e9:.2f} GB/s{'' if good else ' NOT BIT-EXACT'}")
            del out

        for eng in engines:
            root = os.path.join(workdir, f"zs-{eng}")
            with Checkpointer(root, io=IOConfig(engine=eng), keep_last=1) as ck:
                ck.save(1, state).result()
                _pool_ready()  # rows measure the steady state; the one-shot rows, a process without a pool
                for _ in range(repeat):
                    for t in _flat(target):
                        t.zero_()
                    timed(f"zerostall-{eng} in place", lambda: ck.load(target, step=1), root)
                    timed(f"zerostall-{eng} new dict", lambda: ck.load(step=1, **to), root)
                    for t in _flat(target):
                        t.zero_()
                    timed(f"zerostall.load-{eng} in place", lambda: zs_load(root, target, step=1, io=IOConfig(engine=eng)),
                          root)
                    if cuda:
                        timed(f"zerostall.load-{eng} new dict",
                              lambda: zs_load(root, step=1, io=IOConfig(engine=eng), **to), root)
            shutil.rmtree(root, ignore_errors=True)
        import torch.distributed.checkpoint as dcp
        root = os.path.join(workdir, "dcp")
        dcp.save(state, storage_writer=dcp.FileSystemWriter(root), no_dist=True)
        for _ in range(repeat):
            for t in _flat(target):
                t.zero_()
            timed("dcp.load in place", lambda: (dcp.load(target, storage_reader=dcp.FileSystemReader(root),
                                                         no_dist=True), target)[1], root)
        shutil.rmtree(root, ignore_errors=True)
        root = os.path.join(workdir, "torch")
        os.makedirs(root)
        path = os.path.join(root, "state.pt")
        torch.save(state, path)
        for _ in range(repeat):
            timed("torch.load", lambda: torch.load(path, weights_only=True, **to), root)
            if cuda:
                continue  # mmap + touch measures the page cache's CPU path only

            def mm() -> Any:
                out = torch.load(path, weights_only=True, mmap=True)
                _touch(out)
                return out
            timed("torch.load(mmap=True)+touch", mm, root)
        shutil.rmtree(root, ignore_errors=True)
        if not cuda:  # a fresh process per load, methods alternating: a job after a restart
            from .coldload import run_cold_loads, save_all
            cold = os.path.join(workdir, "cold")
            for r in run_cold_loads(size_gib, repeat, save_all(size_gib, cold)):
                name = {"zerostall": "zerostall.load in place", "dcp": "dcp.load in place",
                        "torch": "torch.load"}[r["method"]] + " (fresh process)"
                # the load alone, and with the imports the method's first call needs (paid once)
                for row, s in ((name, r["s"]), (name[:-1] + ", with its imports)", r["s"] + r["import_s"])):
                    rows.setdefault(row, []).append(s)
                    ok[row] = ok.get(row, True) and r["verified"]
                console.print(f"  {name}: {size / r['s'] / 1e9:.2f} GB/s, imports {r['import_s']:.2f} s "
                              f"(load {r['load_avg']:.1f}){'' if r['verified'] else ' NOT BIT-EXACT'}")
            shutil.rmtree(cold, ignore_errors=True)
    finally:
        if own:
            shutil.rmtree(workdir, ignore_errors=True)
    read = float(line.get("read_gbps") or 0.0)
    med = {k: size / statistics.median(v) / 1e9 for k, v in rows.items()}
    dcp_gbps = med.get("dcp.load in place")
    results = [{"method": k, "device": device, "restore_gbps": g,
                "fraction_of_read_line_rate": g / read if read else None,
                "vs_dcp_load": g / dcp_gbps if dcp_gbps else None, "runs_s": rows[k], "verified": ok[k]}
               for k, g in med.items()]
    return {"scenario": "restore", "device": device,
            "device_name": torch.cuda.get_device_name() if device != "cpu" else "cpu", "size_bytes": size,
            "line_rate": line, "repeat": repeat,
            "load_avg": os.getloadavg(), "results": results}


def print_restore(doc: dict[str, Any], console: Any) -> None:
    from rich.table import Table
    lr = doc["line_rate"]
    t = Table(title=f"restore into {doc.get('device', 'cpu')}, {doc['size_bytes'] / 2**30:.2f} GiB, "
                    f"page cache dropped, median of "
                    f"{doc['repeat']}; read line rate {lr.get('read_gbps', 0):.2f} GB/s ({lr.get('tool')}); "
                    f"load {doc['load_avg'][0]:.1f}")
    for c in ("method", "restore GB/s", "x read line rate", "x dcp.load", "ok"):
        t.add_column(c, justify="left" if c == "method" else "right")
    for r in doc["results"]:
        t.add_row(r["method"], f"{r['restore_gbps']:.2f}",
                  "-" if r["fraction_of_read_line_rate"] is None else f"{r['fraction_of_read_line_rate']:.2f}",
                  "-" if r["vs_dcp_load"] is None else f"{r['vs_dcp_load']:.2f}", "yes" if r["verified"] else "NO")
    console.print(t)


def main(a: Any) -> int:
    """``zerostall bench --scenario restore``."""
    import warnings

    warnings.filterwarnings("ignore", message=".*assuming the intent is to")  # DCP without a process group
    console = _term.console()
    doc = run_restore_bench(a.size_gib, a.repeat, a.dir, None, console, device=getattr(a, "device", "cpu"))
    print_restore(doc, console)
    if a.json:
        write_doc(doc, a.json)
        console.print(f"wrote {a.json}")
    return 0 if all(r["verified"] for r in doc["results"]) else 1
