"""Interleaved A/B of the restore read pipeline: another revision's restore/stream.py ("old")
against this tree's ("new"), in one process, same Checkpointer and files, page cache dropped
before each load (produced bench/results/rate-restore-ab-*-2026-12-01.json).

    git show main:src/zerostall/restore/stream.py > src/zerostall/restore/_stream_main.py
    VAR=old,new WHICH=inplace,new,oneshot REP=5 ENG=uring JSON=out.json .venv/bin/python bench/scripts/restore_ab.py
    rm src/zerostall/restore/_stream_main.py

VAR entries: old | new, optionally @FRACTION (stream.ROLLBACK_FRACTION). Data under /tmp, deleted after.
"""
import os, time, shutil, statistics, torch
from zerostall import Checkpointer, load as zs_load
from zerostall.config import IOConfig
from zerostall_bench.restore import _flat, _drop, _equal, _pool_ready
from zerostall_bench.model import gpt_state_for_size, settle_gc
from zerostall_bench.hostinfo import line_rate
from zerostall.restore import step as rstep, stream as snew, _stream_main as sold
size = float(os.environ.get("GIB", "2")); rep = int(os.environ.get("REP", "3"))
eng = os.environ.get("ENG", "uring"); which = os.environ.get("WHICH", "inplace").split(",")
variants = os.environ.get("VAR", "old,new").split(",")
import tempfile
wd = tempfile.mkdtemp(prefix="zerostall-restore-ab-")
state = gpt_state_for_size(int(size * (1 << 30)))
n = sum(t.numel() * t.element_size() for t in _flat(state))
target = {k: {m: torch.zeros_like(t) for m, t in v.items()} for k, v in state.items()}
settle_gc()
res = {}
lr = line_rate(wd, min(n, 2 << 30) >> 20 << 20)["read_gbps"] if os.environ.get("LINE", "1") == "1" else 0
print("line read", lr)
root = os.path.join(wd, "zs")
def setvar(v):
    name, _, frac = v.partition("@")
    mod = sold if name == "old" else snew
    rstep.Plan, rstep.stream = mod.Plan, mod
    rstep.FileRead = mod.FileRead
    if frac: mod.ROLLBACK_FRACTION = float(frac)
def timed(name, fn):
    _drop(root); t0 = time.perf_counter(); out = fn(); dt = time.perf_counter() - t0
    ok = _equal(state, out); s = rstep.last_stats
    print(f"{name}: {n/dt/1e9:.2f} GB/s ok={ok} wait={s.wait_s:.2f} rb={s.rollback_bytes>>20} def={s.deferred_bytes>>20} load={os.getloadavg()[0]:.1f}", flush=True)
    res.setdefault(name, []).append(n / dt / 1e9)
with Checkpointer(root, io=IOConfig(engine=eng), keep_last=1) as ck:
    ck.save(1, state).result(); _pool_ready()
    for _ in range(rep):
        for v in variants:
            setvar(v)
            if "inplace" in which:
                for t in _flat(target): t.zero_()
                timed(f"{v} inplace", lambda: ck.load(target, step=1))
            if "new" in which:
                timed(f"{v} new", lambda: ck.load(step=1))
            if "oneshot" in which:
                for t in _flat(target): t.zero_()
                timed(f"{v} oneshot", lambda: zs_load(root, target, step=1, io=IOConfig(engine=eng)))
med = {k: statistics.median(v) for k, v in res.items()}
print({k: (round(g, 2), round(g / lr, 2) if lr else None) for k, g in med.items()})
if os.environ.get("JSON"):
    import json, subprocess
    doc = {"scenario": "restore A/B, one process, interleaved: main's restore/stream.py ('old') vs this branch's ('new'), "
                       "same Checkpointer, same files, page cache dropped before each load",
           "size_bytes": n, "engine": eng, "repeat": rep, "read_line_rate_gbps": lr, "line_rate_tool": "probe",
           "commit": subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True).stdout.strip(),
           "load_avg_end": os.getloadavg(),
           "rows": [{"variant": k, "median_gbps": g, "fraction_of_read_line_rate": g / lr if lr else None,
                     "runs_gbps": res[k]} for k, g in med.items()]}
    json.dump(doc, open(os.environ["JSON"], "w"), indent=1)
shutil.rmtree(wd, ignore_errors=True)
