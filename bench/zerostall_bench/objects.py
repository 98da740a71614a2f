"""``zerostall bench --scenario objects``: Python-object state (a config tree, a trainer's log
history) saved by zerostall against ``torch.save`` and ``json.dumps`` of the same, in one run.

Three states: ``config`` (a nested tree of dicts/lists/str/int/float/bool, ``--config-mib``
of JSON), ``log`` (``--log-entries`` small dicts, a Hugging Face-style log history) and
``both`` (the two plus four 8 MiB tensors). For each: a reused Checkpointer's first save
(``save()`` stall and durable), then ``--repeat`` steady saves, each after appending one log
entry and bumping the step (what a trainer does between saves): the median ``save()`` stall
(the caller's blocked time) and durable (``handle.wait()``); ``torch.save`` + fsync of the
same state and ``json.dumps`` of its Python part (medians of ``--repeat``). A probe thread
(small torch ops in a loop, standing in for training) records its longest pause during each
save, up to durable and up to ``result()`` (retention of ``keep_last=2`` included): the GIL
held by the save's work on any thread. Each saved state is
loaded back and compared. Runs on the caller's thread.
"""

from __future__ import annotations

import json
import os
import random
import shutil
import statistics
import tempfile
import time
from typing import Any

import torch

from zerostall import _term

from .report import write_doc


def config_tree(mib: float, seed: int = 0) -> dict[str, Any]:
    """A nested config of about ``mib`` MiB of JSON: sections of dicts and lists of str, int,
    float and bool leaves (a large experiment config or a dataset manifest)."""
    rng = random.Random(seed)
    words = ["model", "layer", "attention", "hidden", "dropout", "optimizer", "schedule", "dataset",
             "path", "shard", "tokenizer", "vocab", "rope", "theta", "norm", "eps", "warmup", "decay"]

    def leaf() -> Any:
        r = rng.random()
        if r < 0.45:
            return "/".join(rng.choice(words) for _ in range(rng.randint(2, 6)))
        if r < 0.7:
            return rng.randint(-10 ** 6, 10 ** 9)
        if r < 0.93:
            return rng.random() * 10 ** rng.randint(-6, 4)
        return rng.random() < 0.5

    out: dict[str, Any] = {}
    target, size, i = int(mib * (1 << 20)), 0, 0
    while size < target:
        sec = {f"{rng.choice(words)}_{j}": ({f"{rng.choice(words)}_{k}": leaf() for k in range(8)}
                                            if j % 3 else [leaf() for _ in range(12)]) for j in range(24)}
        out[f"section_{i}"] = sec
        size += len(json.dumps(sec))
        i += 1
    return out


def log_entry(i: int) -> dict[str, Any]:
    return {"loss": 2.5 / (i + 1), "grad_norm": 0.25 + i % 7, "learning_rate": 3e-4 * (1 - i / 1e6),
            "epoch": i / 1000, "step": i}


def states(config_mib: float, log_entries: int) -> dict[str, dict[str, Any]]:
    g = torch.Generator().manual_seed(0)
    cfg = config_tree(config_mib)
    return {
        "config": {"config": cfg, "step": 0},
        "log": {"trainer": {"log_history": [log_entry(i) for i in range(log_entries)], "global_step": 0}},
        "both": {"model": {f"w{i}": torch.randn(2 << 20, generator=g) for i in range(4)},
                 "config": config_tree(config_mib, 1),
                 "trainer": {"log_history": [log_entry(i) for i in range(log_entries)], "global_step": 0}},
    }


def _python_part(state: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in state.items() if k != "model"}


def _advance(state: dict[str, Any], r: int) -> None:
    """What a trainer changes between two saves: one more log entry, the step."""
    if "trainer" in state:
        hist = state["trainer"]["log_history"]
        hist.append(log_entry(len(hist)))
        state["trainer"]["global_step"] = r
    else:
        state["step"] = r


def _equal(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and torch.equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(_equal(a[k], b[k]) for k in a)
    if isinstance(a, list):
        return isinstance(b, list) and len(a) == len(b) and all(map(_equal, a, b))
    return type(a) is type(b) and a == b


def _median(fn: Any, repeat: int) -> float:
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


class Probe:
    """A thread standing in for the training loop: small torch ops back to back, each
    iteration's end time recorded. :meth:`max_gap` is the longest pause between two iterations
    in a window: how long the training thread could not run (the GIL held by a save's work,
    on the caller's thread or in the background)."""

    def __init__(self) -> None:
        import threading
        self.ends: list[float] = []
        self._stop = threading.Event()
        self._t = threading.Thread(target=self._run, name="bench-probe", daemon=True)
        self._t.start()

    def _run(self) -> None:
        a = torch.randn(64, 64)
        while not self._stop.is_set():
            a = torch.tanh(a @ a)
            self.ends.append(time.perf_counter())
            time.sleep(0.0005)

    def max_gap(self, t0: float, t1: float) -> float:
        """The longest time in [t0, t1] without an iteration ending (the window's edges count)."""
        ends = [t0] + [t for t in self.ends if t0 < t < t1] + [t1]
        return max(b - a for a, b in zip(ends, ends[1:]))

    def stop(self) -> None:
        self._stop.set()
        self._t.join()


def run_one(name: str, state: dict[str, Any], repeat: int, workdir: str) -> dict[str, Any]:
    import zerostall
    root = os.path.join(workdir, f"zs-{name}")
    out: dict[str, Any] = {"json_bytes": len(json.dumps(_python_part(state)))}
    probe = Probe()
    try:
        _run_zerostall(out, zerostall, root, state, repeat, probe)
        _run_torch(out, name, state, repeat, workdir, probe)
    finally:
        probe.stop()
    py = _python_part(state)
    out["json_dumps_s"] = _median(lambda: json.dumps(py), repeat)
    out["ratios"] = {"stall_vs_json_dumps": out["stall_s"] / out["json_dumps_s"],
                     "stall_vs_torch_save": out["stall_s"] / out["torch_save_s"],
                     "durable_vs_torch_save": out["durable_s"] / out["torch_save_s"],
                     "first_stall_vs_json_dumps": out["first_stall_s"] / out["json_dumps_s"]}
    return out


def _run_zerostall(out: dict[str, Any], zerostall: Any, root: str, state: dict[str, Any], repeat: int,
                   probe: Probe) -> None:
    with zerostall.Checkpointer(root, keep_last=2) as ck:
        t0 = time.perf_counter()
        h = ck.save(0, state)
        out["first_stall_s"] = time.perf_counter() - t0
        h.wait()
        out["first_durable_s"] = time.perf_counter() - t0
        h.result()
        stalls, durables, results, gaps, gaps_result = [], [], [], [], []
        for r in range(1, repeat + 1):
            _advance(state, r)
            time.sleep(0.05)
            t0 = time.perf_counter()
            h = ck.save(r, state)
            stalls.append(time.perf_counter() - t0)
            h.wait()
            t1 = time.perf_counter()
            durables.append(t1 - t0)
            h.result()
            results.append(time.perf_counter() - t0)
            gaps.append(probe.max_gap(t0, t1))
            gaps_result.append(probe.max_gap(t0, time.perf_counter()))
        out.update(stall_s=statistics.median(stalls), durable_s=statistics.median(durables), stall_all_s=stalls,
                   result_s=statistics.median(results), probe_max_gap_s=statistics.median(gaps),
                   probe_max_gap_to_result_s=statistics.median(gaps_result))
        out["verified"] = _equal(state, ck.load(step=repeat))
    shutil.rmtree(root, ignore_errors=True)


def _run_torch(out: dict[str, Any], name: str, state: dict[str, Any], repeat: int, workdir: str,
               probe: Probe) -> None:
    path = os.path.join(workdir, f"{name}.pt")
    times, gaps = [], []
    for _ in range(repeat):
        time.sleep(0.05)
        t0 = time.perf_counter()
        with open(path, "wb") as f:
            torch.save(state, f)
            f.flush()
            os.fsync(f.fileno())
        times.append(time.perf_counter() - t0)
        gaps.append(probe.max_gap(t0, time.perf_counter()))
    out["torch_save_s"], out["torch_save_probe_max_gap_s"] = statistics.median(times), statistics.median(gaps)
    os.unlink(path)


def run_objects(config_mib: float, log_entries: int, repeat: int, workdir: str | None, console: Any,
                only: tuple[str, ...] = ("config", "log", "both")) -> dict[str, Any]:
    own = workdir is None
    workdir = workdir or tempfile.mkdtemp(prefix="zerostall-bench-objects-", dir=os.getcwd())
    os.makedirs(workdir, exist_ok=True)
    doc: dict[str, Any] = {"scenario": "objects", "config_mib": config_mib, "log_entries": log_entries,
                           "repeat": repeat, "load_avg_start": list(os.getloadavg())}
    try:
        for name, state in states(config_mib, log_entries).items():
            if name in only:
                doc[name] = res = run_one(name, state, repeat, workdir)
                console.print(f"  {name}: {res}")
    finally:
        if own:
            shutil.rmtree(workdir, ignore_errors=True)
    doc["load_avg_end"] = list(os.getloadavg())
    return doc


def main(a: Any) -> int:
    """``zerostall bench --scenario objects``."""
    console = _term.console()
    doc = run_objects(a.config_mib, a.log_entries, a.repeat, a.dir, console)
    ok = True
    for name in ("config", "log", "both"):
        r = doc.get(name)
        if r is None:
            continue
        ok = ok and r["verified"]
        console.print(f"{name} ({r['json_bytes'] / 2**20:.1f} MiB JSON): save() stall {r['stall_s'] * 1e3:.0f} ms "
                      f"(first {r['first_stall_s'] * 1e3:.0f} ms), durable {r['durable_s'] * 1e3:.0f} ms; "
                      f"json.dumps {r['json_dumps_s'] * 1e3:.0f} ms, torch.save {r['torch_save_s'] * 1e3:.0f} ms: "
                      f"stall {r['ratios']['stall_vs_json_dumps']:.2f}x json.dumps, "
                      f"{r['ratios']['stall_vs_torch_save']:.2f}x torch.save; durable "
                      f"{r['ratios']['durable_vs_torch_save']:.2f}x torch.save; a training thread's longest pause "
                      f"{r['probe_max_gap_s'] * 1e3:.0f} ms to durable, {r['probe_max_gap_to_result_s'] * 1e3:.0f} ms to result() (torch.save {r['torch_save_probe_max_gap_s'] * 1e3:.0f} ms); "
                      f"verified {r['verified']}")
    write_doc(doc, a.json)
    return 0 if ok else 1
