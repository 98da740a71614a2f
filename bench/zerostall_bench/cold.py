"""The cold scenario: a fresh process, the method's very first save, the trainer in-process.

Run by ``zerostall bench`` as ``python -m zerostall_bench.cold --method M --size-gib S --dir D
--out F``: builds the state, runs the trainer's baseline, then times the method's setup plus
its first ``save`` (what a user's first checkpoint costs, allocation and faulting included)
and keeps stepping until it is durable. Writes one JSON object to ``--out``.
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import shutil
import time
import warnings

import torch

from .inproc import StepLoop, measure
from .methods import available_methods
from .model import gpt_state_for_size, settle_gc


def _hwm_bytes() -> int:
    """This process's peak RSS (``VmHWM``: per address space, so not the parent's, which
    ``ru_maxrss`` carries across ``exec``)."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    return 0


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--method", required=True)
    p.add_argument("--size-gib", type=float, required=True)
    p.add_argument("--dir", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--settle-s", type=float, default=1.0)
    p.add_argument("--device", default="cpu", help="where the state lives (as the bench's --device)")
    a = p.parse_args()
    warnings.filterwarnings("ignore")
    torch.set_num_threads(1)
    m = available_methods()[a.method]
    m.cold = True
    for mod in m.imports:  # a training script has imported its checkpoint library already
        importlib.import_module(mod)
    state = gpt_state_for_size(int(a.size_gib * (1 << 30)))
    if a.device != "cpu":
        from .bench import _map
        state = _map(state, lambda t: t.to(a.device))
    settle_gc()
    loop = StepLoop(log_dir=a.dir)
    root = os.path.join(a.dir, "cold-" + a.method.replace(".", "_"))
    shutil.rmtree(root, ignore_errors=True)
    box: dict[str, float] = {}

    def start():
        t0 = time.perf_counter()
        m.setup(root, state)
        box["setup_s"] = time.perf_counter() - t0
        return m.start(0, state)

    try:
        r = measure(loop, start, a.settle_s)
    finally:
        m.close()
        loop.close()
        shutil.rmtree(root, ignore_errors=True)
    out = {"cold_stall_s": r["blocked_s"], "cold_setup_s": box.get("setup_s", 0.0),
           "cold_durable_s": r["durable_wall_s"], "cold_lost_s": r["lost_s"],
           "cold_rss_peak_bytes": _hwm_bytes()}
    with open(a.out, "w") as f:
        json.dump(out, f)


if __name__ == "__main__":
    main()
