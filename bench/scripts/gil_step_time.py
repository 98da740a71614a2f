"""Does the background pipeline slow the training thread (the GIL question)?

Trains the demo GPT in this process and times every step, three ways in one run:
no checkpointing; a save every --every steps with each engine (snapshot, persist and
commit running on zerostall's threads while the loop continues). Prints median and p90
step time and the ratio to the baseline.

Usage: python bench/scripts/gil_step_time.py [--steps 120] [--every 5] [--dir DIR]
"""

import argparse
import os
import shutil
import statistics
import tempfile
import time

import torch
import torch.nn.functional as F

from zerostall import Checkpointer, IOConfig
from zerostall.demo.run import BATCH, DEMO_CFG
from zerostall.demo.model import TinyGPT, batch, corpus, encode


def run(steps, every, ckdir, engine):
    torch.manual_seed(0)
    model = TinyGPT(DEMO_CFG)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    data = encode(corpus(), DEMO_CFG.vocab)
    times = []
    ck = Checkpointer(ckdir, io=IOConfig(engine=engine), keep_last=2) if engine else None
    if ck:
        ck.guard(opt)
    for step in range(steps):
        t0 = time.perf_counter()
        x, y = batch(data, step, 0, BATCH, DEMO_CFG.ctx)
        F.cross_entropy(model(x).flatten(0, 1), y.flatten()).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        if ck and step == 0:
            ck.prepare({"model": model.state_dict(), "optim": opt.state_dict()})
        if ck and step % every == 0:
            ck.save(step, {"model": model.state_dict(), "optim": opt.state_dict()})
        times.append(time.perf_counter() - t0)
    if ck:
        ck.close()
    return times[5:]


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=120)
    p.add_argument("--every", type=int, default=5)
    p.add_argument("--dir")
    a = p.parse_args()
    torch.set_num_threads(max(1, min(2, os.cpu_count() or 1)))
    root = a.dir or tempfile.mkdtemp(prefix="zerostall-gil-")
    print(f"GPT {DEMO_CFG.n_params / 1e6:.1f} M params (checkpoint ~{DEMO_CFG.n_params * 12 / 2**20:.0f} MiB), "
          f"a save every {a.every} steps, {a.steps} steps each")
    base = None
    for engine in (None, "uring", "threads", "buffered"):
        d = os.path.join(root, engine or "none")
        t = run(a.steps, a.every, d, engine)
        med, p90 = statistics.median(t), sorted(t)[int(0.9 * len(t))]
        base = base or med
        print(f"{engine or 'no checkpoints':15s} step median {med * 1e3:6.1f} ms  p90 {p90 * 1e3:6.1f} ms  "
              f"ratio {med / base:.3f}")
    if a.dir is None:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
