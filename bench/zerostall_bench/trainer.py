"""The victim: a training loop in its own process whose every step is timed.

Each step is a matmul sized to about ``--step-ms`` plus a 4 KiB append to a log file in the
checkpoint's filesystem (trainers log); a step that blocks in ``balance_dirty_pages`` shows
up as a long step. Runs until ``--stop`` exists, then writes ``[[t_start, seconds], ...]``
to ``--out`` as JSON. Started and stopped by the bench harness.
"""

from __future__ import annotations

import argparse
import json
import os
import time

import torch


def calibrate(step_ms: float) -> int:
    n = 256
    while n < 4096:
        a = torch.randn(n, n)
        torch.mm(a, a)
        t0 = time.perf_counter()
        torch.mm(a, a)
        if (time.perf_counter() - t0) * 1e3 >= step_ms:
            return n
        n = int(n * 1.15)
    return n


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--log", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--stop", required=True)
    p.add_argument("--ready", required=True)
    p.add_argument("--step-ms", type=float, default=10.0)
    a = p.parse_args()
    torch.set_num_threads(1)
    n = calibrate(a.step_ms)
    x = torch.randn(n, n)
    line = (b"x" * 4095) + b"\n"
    fd = os.open(a.log, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    steps: list[tuple[float, float]] = []
    open(a.ready, "w").close()
    parent = os.getppid()
    while not os.path.exists(a.stop):
        if os.getppid() != parent:  # the bench died (killed, timed out): do not outlive it
            os.close(fd)
            return
        t0 = time.perf_counter()
        wall = time.time()
        torch.mm(x, x)
        os.write(fd, line)
        steps.append((wall, time.perf_counter() - t0))
    os.close(fd)
    with open(a.out, "w") as f:
        json.dump(steps, f)


if __name__ == "__main__":
    main()
