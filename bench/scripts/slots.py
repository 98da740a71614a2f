"""How many snapshots should the staging arena hold? Measures 1 vs 2 slots.

For each slot count, in this process with a fresh staging pool: (a) the first save (arena
faulted in the background meanwhile): time until staged and durable, and the bytes faulted;
(b) a second save issued right after the first is staged (checkpoints closer together than
one persist): how long it takes to be staged, i.e. how long a guarded ``opt.step()`` would
wait; (c) a save issued after the previous one is durable (the usual case: the checkpoint
interval is longer than the persist).
Usage: python bench/scripts/slots.py [--size-mib 1024] [--dir DIR] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import shutil
import tempfile
import time

import torch

from zerostall import Checkpointer, CheckpointConfig, StagingConfig
from zerostall_bench.model import gpt_state_for_size
from zerostall.saving import pool


def one(slots: int, state, root: str) -> dict:
    pool.release_now()
    cfg = CheckpointConfig(staging=StagingConfig(slots=slots), keep_last=2)
    out = {"slots": slots}
    with Checkpointer(root, cfg) as ck:
        t0 = time.perf_counter()
        h1 = ck.save(1, state)
        h1.wait_staged()
        out["first_staged_s"] = time.perf_counter() - t0
        t1 = time.perf_counter()
        h2 = ck.save(2, state)  # right behind the first one
        h2.wait_staged()
        out["back_to_back_staged_s"] = time.perf_counter() - t1
        h1.result()
        out["first_durable_s"] = h1.result().durable_s
        h2.result()
        t2 = time.perf_counter()
        h3 = ck.save(3, state)  # spaced: the previous save is durable
        h3.wait_staged()
        out["spaced_staged_s"] = time.perf_counter() - t2
        out["spaced_durable_s"] = h3.result().durable_s
        out["arena_faulted_bytes"] = ck.arena.ready
        out["fault_s"] = ck.arena.fault_s
    shutil.rmtree(root, ignore_errors=True)
    return out


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--size-mib", type=int, default=1024)
    p.add_argument("--dir", default=None)
    p.add_argument("--json", default=None)
    a = p.parse_args()
    torch.set_num_threads(1)
    state = gpt_state_for_size(a.size_mib << 20)
    base = tempfile.mkdtemp(prefix="zerostall-slots-", dir=a.dir)
    rows = [one(s, state, f"{base}/s{s}") for s in (1, 2, 1, 2)]
    for r in rows:
        print(json.dumps(r))
    shutil.rmtree(base, ignore_errors=True)
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"size_mib": a.size_mib, "date": time.strftime("%Y-%m-%d %H:%M %Z"), "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
