"""``zerostall bench``: every method, the same state, the same disk, the same run.

For each method:

1. **cold** (unless ``--no-cold``): a fresh process (:mod:`.cold`) builds the state and
   times the method's setup plus its first save, with the trainer in that process;
2. for each repeat, **separate trainer**: start the trainer process (the victim), let it
   settle, save, wait until durable, stop the trainer, drop the files' pages from the cache,
   restore into a pre-allocated state (where the method can), compare bit for bit. A sampler
   records nr_dirty / nr_writeback / PSI every 100 ms meanwhile;
3. for each repeat, **same-process trainer** (:mod:`.inproc`): the training loop runs in this
   process's main thread and calls the save itself, as a real training script does;
4. for the zerostall Checkpointer methods, a save to a **new path** through a fresh
   Checkpointer (constructor + ``save()``), with the process's staging pool already warm.

The headline per method is **training time lost per checkpoint** = time blocked in save() +
the sum over the steps taken during the save of (step time - baseline median step time),
for both trainers (``lost_s``: the separate process, plus the blocked time; ``inproc_lost_s``).
Medians over ``--repeat`` runs, with min and max. The JSON document's field names are a
contract (see docs/benchmarks.md). A method that cannot run here is reported with ``unavailable``;
one that fails mid-run with ``error`` (the bench goes on with the next).

With ``--json`` the document is rewritten after every method with ``"complete": false``
(so an OOM kill or a Ctrl-C late in a long run keeps what was measured) and once more with
``"complete": true`` at the end. Between methods the bench frees what the last one held
(the method's objects, the process's staging pool, glibc's free heap): each row's
``rss_peak_bytes`` is this process's peak during its saves, ``cold_rss_peak_bytes`` the
cold child's.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Any

import torch

from zerostall import _term
from zerostall.config import IOConfig
from zerostall.telemetry.host import Sampler
from .hostinfo import line_rate, machine, memcpy_gbps
from .methods import Method, available_methods
from zerostall.store.files import drop_cache
from .model import gpt_state_for_size, settle_gc, states_equal
from .report import _summary, plot, print_table, write_doc

NUMERIC = ("stall_s", "staged_s", "durable_s", "persist_gbps", "fraction_of_line_rate", "dirty_peak_bytes",
           "writeback_peak_bytes", "psi_io_full_peak", "step_p50_ms", "step_p99_ms", "step_max_ms",
           "steps_over_2x_median", "rss_peak_bytes", "restore_s", "restore_gbps",
           "restore_fraction_of_read_line_rate", "lost_s",
           "inproc_lost_s", "inproc_stall_s", "inproc_durable_s", "inproc_step_max_ms")
COLD = ("cold_stall_s", "cold_setup_s", "cold_durable_s", "cold_lost_s", "cold_rss_peak_bytes")


def _map(x: Any, fn: Any) -> Any:
    if isinstance(x, torch.Tensor):
        return fn(x)
    if isinstance(x, dict):
        return {k: _map(v, fn) for k, v in x.items()}
    return x


def _nbytes(state: Any) -> int:
    if isinstance(state, torch.Tensor):
        return state.numel() * state.element_size()
    if isinstance(state, dict):
        return sum(_nbytes(v) for v in state.values())
    return 0


def _drop_cache(paths: list[str]) -> None:
    for p in paths:
        drop_cache(p, sync=True)


class Trainer:
    """The victim process; see :mod:`.trainer`."""

    def __init__(self, workdir: str, throttle: Any = None):
        self.dir = tempfile.mkdtemp(prefix="trainer-", dir=workdir)
        self.stop_file = os.path.join(self.dir, "stop")
        self.out = os.path.join(self.dir, "steps.json")
        ready = os.path.join(self.dir, "ready")
        self.proc = subprocess.Popen([sys.executable, "-m", "zerostall_bench.trainer", "--log",
                                      os.path.join(self.dir, "train.log"), "--out", self.out,
                                      "--stop", self.stop_file, "--ready", ready])
        if throttle is not None:
            throttle.exempt(self.proc.pid)
        deadline = time.monotonic() + 120
        while not os.path.exists(ready):
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError("the bench trainer process failed to start")
            time.sleep(0.01)

    def abort(self) -> None:
        """Stop the trainer without its results (the measured save failed)."""
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(timeout=60)
        shutil.rmtree(self.dir, ignore_errors=True)

    def finish(self) -> list[tuple[float, float]]:
        open(self.stop_file, "w").close()
        self.proc.wait(timeout=600)
        with open(self.out) as f:
            steps = [tuple(s) for s in json.load(f)]
        shutil.rmtree(self.dir, ignore_errors=True)
        return steps  # type: ignore[return-value]


def _step_stats(steps: list[tuple[float, float]], t0: float, t1: float) -> dict[str, float]:
    base = [d for t, d in steps if t < t0] or [d for _, d in steps]
    during_real = [d for t, d in steps if t0 <= t <= t1]
    during = during_real or [0.0]
    med = statistics.median(base)
    during_sorted = sorted(during)
    p = lambda q: during_sorted[min(len(during_sorted) - 1, int(q * len(during_sorted)))]  # noqa: E731
    return {"step_p50_ms": p(0.5) * 1e3, "step_p99_ms": p(0.99) * 1e3, "step_max_ms": max(during) * 1e3,
            "steps_over_2x_median": sum(1 for d in during if d > 2 * med), "baseline_p50_ms": med * 1e3,
            "excess_s": sum(d - med for d in during_real)}


def run_one(m: Method, step: int, state: Any, target: Any, size: int, line: dict[str, Any],
            workdir: str, throttle: Any, settle_s: float) -> dict[str, Any]:
    trainer = Trainer(workdir, throttle)
    sampler = None
    try:
        time.sleep(settle_s)
        sampler = Sampler(0.1, keep_series=True)
        t_wall = time.time()
        stall, staged, durable = m.start(step, state).wait()
        time.sleep(0.3)
    except BaseException:
        if sampler is not None:
            sampler.stop()
        trainer.abort()  # it ran on as an orphan, a core busy, for the rest of the session
        raise
    tel = sampler.stop()
    steps = trainer.finish()
    stats = _step_stats(steps, t_wall, t_wall + durable)
    stats["lost_s"] = stall + stats.pop("excess_s")
    _drop_cache(m.files(step))
    t0 = time.perf_counter()
    restored = m.restore(step, target)
    restore_s = time.perf_counter() - t0
    verified = states_equal(state, restored)
    m.cleanup(step)
    persist = size / durable / 1e9
    return {"stall_s": stall, "staged_s": staged, "durable_s": durable, "persist_gbps": persist,
            "fraction_of_line_rate": persist / line["write_gbps"] if line.get("write_gbps") else 0.0,
            "dirty_peak_bytes": tel["dirty_peak_bytes"], "writeback_peak_bytes": tel["writeback_peak_bytes"],
            "psi_io_full_peak": tel["psi_io_full_peak"], "rss_peak_bytes": tel["rss_peak_bytes"],
            "restore_s": restore_s, "restore_gbps": size / restore_s / 1e9, "verified": verified, **stats,
            "restore_fraction_of_read_line_rate": (size / restore_s / 1e9 / line["read_gbps"]
                                                   if line.get("read_gbps") else 0.0),
            "_series": {"t0": t_wall, "steps": [(t - t_wall, d * 1e3) for t, d in steps],
                        "dirty": [(s.t - t_wall, s.dirty_bytes) for s in sampler.series]}}


def run_inproc(m: Method, step: int, state: Any, loop: Any, settle_s: float) -> dict[str, float]:
    """The trainer in this process: it calls the save and keeps stepping until durable."""
    from .inproc import measure
    r = measure(loop, lambda: m.start(step, state), settle_s)
    m.cleanup(step)
    return {"inproc_lost_s": r["lost_s"], "inproc_stall_s": r["blocked_s"], "inproc_durable_s": r["durable_s"],
            "inproc_step_max_ms": r["step_max_ms"]}


COLD_TIMEOUT_S = 900.0


def run_cold(name: str, size_gib: float, workdir: str, settle_s: float,
             device: str = "cpu") -> dict[str, float] | None:
    """The method's first save in a fresh process (see :mod:`.cold`), the state on ``device``;
    None if it failed or timed out."""
    from zerostall.saving import pool
    pool.release_now()  # this process's staging memory is not the child's business
    out = os.path.join(workdir, "cold.json")
    try:
        proc = subprocess.run([sys.executable, "-m", "zerostall_bench.cold", "--method", name, "--size-gib",
                               str(size_gib), "--dir", workdir, "--out", out, "--settle-s", str(settle_s),
                               "--device", device],
                              capture_output=True, text=True, timeout=COLD_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        print(f"bench: cold run of {name} did not finish within {COLD_TIMEOUT_S:.0f} s", file=sys.stderr)
        return None
    if proc.returncode != 0:
        print(f"bench: cold run of {name} failed:\n{proc.stderr[-2000:]}", file=sys.stderr)
        return None
    with open(out) as f:
        doc = json.load(f)
    os.unlink(out)
    return doc


def new_path_stall(engine: str, root: str, state: Any) -> dict[str, float]:
    """A fresh Checkpointer on a new path saving once, the staging pool already warm."""
    from zerostall.checkpointer import Checkpointer
    t0 = time.perf_counter()
    ck = Checkpointer(root, io=IOConfig(engine=engine))
    t1 = time.perf_counter()
    h = ck.save(0, state)
    t2 = time.perf_counter()
    h.result()
    ck.close()
    shutil.rmtree(root, ignore_errors=True)
    return {"new_path_stall_s": t2 - t0, "new_path_save_s": t2 - t1}


def aggregate(name: str, runs: list[dict[str, Any]], note: str) -> dict[str, Any]:
    out: dict[str, Any] = {"method": name, "repeats": len(runs), "note": note,
                           "verified": all(r["verified"] for r in runs)}
    for k in NUMERIC:
        vals = [r[k] for r in runs]
        out[k] = statistics.median(vals)
    out["min"] = {k: min(r[k] for r in runs) for k in NUMERIC}
    out["max"] = {k: max(r[k] for r in runs) for k in NUMERIC}
    for k in ("steps_over_2x_median", "dirty_peak_bytes", "writeback_peak_bytes", "rss_peak_bytes"):
        out[k] = int(out[k])
    return out


def unavailable_row(name: str, why: str) -> dict[str, Any]:
    return {"method": name, "repeats": 0, "note": why, "unavailable": why, "verified": None,
            **{k: None for k in NUMERIC + COLD}, "min": {}, "max": {}}


def error_row(name: str, exc: BaseException) -> dict[str, Any]:
    """A method that raised mid-run: reported (and the bench fails), the others still run."""
    why = f"{type(exc).__name__}: {exc}"[:500]
    return {"method": name, "repeats": 0, "note": f"failed: {why}", "error": why, "verified": False,
            **{k: None for k in NUMERIC + COLD}, "min": {}, "max": {}}


def free_memory() -> None:
    """Between methods: drop the process's staging pool and unreferenced objects, and hand
    glibc's free heap back to the OS, so the next method (and its cold child) start lean."""
    import gc
    from zerostall.saving import pool
    pool.release_now()
    gc.collect()
    try:
        import ctypes
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass


def run_bench(a: argparse.Namespace, console: Any) -> dict[str, Any]:
    methods = available_methods()
    chosen = a.methods.split(",") if a.methods else list(methods)
    unknown = [m for m in chosen if m not in methods]
    if unknown:
        raise SystemExit(f"bench: unknown method(s) {unknown}; available: {', '.join(methods)}")
    workdir = a.dir or tempfile.mkdtemp(prefix="zerostall-bench-", dir=os.getcwd())
    os.makedirs(workdir, exist_ok=True)
    size_target = int(a.size_gib * (1 << 30))
    console.print(f"building a GPT-style fp32 + AdamW state of ~{a.size_gib} GiB ...")
    state = gpt_state_for_size(size_target)
    if a.device != "cpu":
        state = _map(state, lambda t: t.to(a.device))
    size = _nbytes(state)
    target = _map(state, lambda t: torch.zeros_like(t))
    settle_gc()
    console.print("measuring the disk's line rate and warm memcpy bandwidth ...")
    line = line_rate(workdir, min(size, 2 << 30)) if not a.no_line_rate else {"write_gbps": 0.0, "read_gbps": 0.0, "tool": "skipped"}
    mem = memcpy_gbps()
    torch.set_num_threads(1)  # the in-process trainer's matmul: one thread, like the trainer process
    doc: dict[str, Any] = {"machine": machine(workdir), "date": time.strftime("%Y-%m-%d %H:%M %Z"), "size_bytes": size, "throttle_write_mbps": a.throttle_write_mbps,
                           "device": a.device, "line_rate": line, "memcpy_gbps": mem, "complete": False,
                           "results": []}
    out_json = getattr(a, "json", None)
    series: dict[str, Any] = {}
    try:
        from .throttle import throttle_writes
        ctx = throttle_writes(workdir, a.throttle_write_mbps) if a.throttle_write_mbps else contextlib.nullcontext()
        loops: list[Any] = []  # the in-process trainer, created by the first method that runs
        with ctx as thr:
            for name in chosen:
                m = methods.pop(name)  # dropped after its row, with whatever it still references
                if m.unavailable:
                    console.print(f"  {name}: {m.unavailable}")
                    doc["results"].append(unavailable_row(name, m.unavailable))
                    write_doc(doc, out_json)
                    continue
                try:
                    _run_method(a, m, name, state, target, size, line, workdir, thr, loops, doc, series, console)
                except Exception as exc:  # noqa: BLE001 - reported as the method's row; the others still run
                    console.print(f"  {name}: failed: {type(exc).__name__}: {exc}")
                    doc["results"].append(error_row(name, exc))
                finally:
                    del m
                    free_memory()
                write_doc(doc, out_json)
        for loop in loops:
            loop.close()
    finally:
        if a.dir is None:
            shutil.rmtree(workdir, ignore_errors=True)
    doc["complete"] = True
    if a.plot:
        plot(series, a.plot, doc)
    return doc


def _run_method(a: argparse.Namespace, m: Method, name: str, state: Any, target: Any, size: int,
                line: dict[str, Any], workdir: str, thr: Any, loops: list[Any], doc: dict[str, Any],
                series: dict[str, Any], console: Any) -> None:
    """Cold run, repeats with both trainers, new-path stall: one row in ``doc``. ``loops``
    holds the in-process trainer (created on first use, reused by the next methods)."""
    cold = None
    if not a.no_cold:
        console.print(f"  {name}: cold (fresh process, first save)")
        cold = run_cold(name, a.size_gib, workdir, a.settle_s, a.device)
    m.setup(os.path.join(workdir, name.replace(".", "_")), state)
    try:
        runs = []
        for r in range(a.repeat):
            console.print(f"  {name}: run {r + 1}/{a.repeat} (separate trainer)")
            runs.append(run_one(m, r, state, target, size, line, workdir, thr, a.settle_s))
        if not loops:
            from .inproc import StepLoop
            loops.append(StepLoop(log_dir=workdir))
        loop = loops[0]
        for r in range(a.repeat):
            console.print(f"  {name}: run {r + 1}/{a.repeat} (same-process trainer)")
            runs[r].update(run_inproc(m, 1000 + r, state, loop, a.settle_s))
        series[name] = runs[len(runs) // 2].pop("_series")
        for run in runs:
            run.pop("_series", None)
        row = aggregate(name, runs, m.note)
        row.update({k: (cold or {}).get(k) for k in COLD})
        if name.startswith("zerostall-"):
            row.update(new_path_stall(name.split("-", 1)[1], os.path.join(workdir, "newpath"), state))
        doc["results"].append(row)
        console.print(f"  {name}: {_summary(row)}")
    finally:
        try:
            m.close()
        except Exception as exc:  # noqa: BLE001 - setup may have failed half-way; the first error is reported
            console.print(f"  {name}: close failed: {type(exc).__name__}: {exc}")
        if getattr(m, "root", None):
            shutil.rmtree(m.root, ignore_errors=True)


def main(a: argparse.Namespace) -> int:
    import warnings

    warnings.filterwarnings("ignore", message=".*assuming the intent is to")  # DCP without a process group
    console = _term.console()
    doc = run_bench(a, console)
    print_table(doc, console)
    if a.json:
        write_doc(doc, a.json)
        console.print(f"wrote {a.json}")
    return 0 if all(r["verified"] for r in doc["results"] if not r.get("unavailable")) else 1
