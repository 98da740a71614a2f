"""The trainer in the same process as the save (the real case: one GIL, one address space).

:class:`StepLoop` is the bench trainer's step (a matmul sized to about 10 ms on one thread,
plus a 4 KiB log append), run in the caller's thread. :func:`measure` runs it for a settle
period (the baseline), starts a save, keeps stepping until the save is durable, and returns
the headline metric:

    training time lost = time blocked in save() + sum over the steps taken while the save was
                         in flight of (step time - baseline median step time)

Called from the bench's main thread (or a fresh process for the cold scenario).
"""

from __future__ import annotations

import os
import statistics
import tempfile
import time
from typing import Any, Callable

import torch

from .trainer import calibrate


class StepLoop:
    def __init__(self, step_ms: float = 10.0, log_dir: str | None = None):
        self.n = calibrate(step_ms)
        self.x = torch.randn(self.n, self.n)
        fd, self.log = tempfile.mkstemp(prefix="zerostall-trainer-", suffix=".log", dir=log_dir)
        self.fd = fd
        self.line = (b"x" * 4095) + b"\n"

    def step(self) -> float:
        t0 = time.perf_counter()
        torch.mm(self.x, self.x)
        os.write(self.fd, self.line)
        return time.perf_counter() - t0

    def run_for(self, seconds: float) -> list[float]:
        out = []
        end = time.perf_counter() + seconds
        while time.perf_counter() < end:
            out.append(self.step())
        return out

    def close(self) -> None:
        os.close(self.fd)
        os.unlink(self.log)


def measure(loop: StepLoop, start: Callable[[], Any], settle_s: float = 1.0,
            timeout_s: float = 600.0) -> dict[str, float]:
    """Baseline, then ``start()`` (returns a ``methods.Pending``), stepping until it is durable."""
    base = loop.run_for(settle_s)
    med = statistics.median(base)
    t0 = time.perf_counter()
    p = start()
    blocked = time.perf_counter() - t0
    during: list[float] = []
    while not p.poll():
        during.append(loop.step())
        if time.perf_counter() - t0 > timeout_s:
            raise TimeoutError("the save did not become durable within the bench timeout")
    wall = time.perf_counter() - t0
    excess = sum(d - med for d in during)
    return {"lost_s": blocked + excess, "blocked_s": blocked, "excess_s": excess, "durable_wall_s": wall,
            "durable_s": p.durable_s, "staged_s": p.staged_s, "steps_during": len(during),
            "step_max_ms": max(during, default=0.0) * 1e3, "baseline_step_ms": med * 1e3}
