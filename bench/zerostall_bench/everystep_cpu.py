"""The CPU phase of ``zerostall bench --scenario every-step`` (:mod:`.everystep`): the process
CPU per GiB saved by back-to-back saves, beside the one-pass limit of the same bytes (one copy
and one crc32c pass) measured between its rounds. Runs on the caller's thread.
"""

from __future__ import annotations

import ctypes
import resource
import statistics
import time
from typing import TYPE_CHECKING, Any, Callable

import crc32c
import torch

if TYPE_CHECKING:
    from .everystep import Saver, Trainer


def process_cpu_s() -> float:
    """User + system CPU seconds of this process (every thread, living or exited)."""
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def one_pass_limit(tensors: list[torch.Tensor], repeat: int = 3) -> dict[str, float]:
    """The least CPU one save can cost: each tensor memmoved into a reused buffer, then a
    crc32c pass over the same bytes; one thread each (this one), best of ``repeat`` passes
    after a warm one. Seconds per GiB."""
    total = sum(t.numel() * t.element_size() for t in tensors)
    buf = ctypes.create_string_buffer(total)
    base = ctypes.addressof(buf)
    copies, crcs = [], []
    for r in range(repeat + 1):
        c0 = time.thread_time()
        off = 0
        for t in tensors:
            n = t.numel() * t.element_size()
            ctypes.memmove(base + off, t.data_ptr(), n)
            off += n
        c1 = time.thread_time()
        off = 0
        for t in tensors:
            n = t.numel() * t.element_size()
            crc32c.crc32c((ctypes.c_char * n).from_address(base + off))
            off += n
        c2 = time.thread_time()
        if r:
            copies.append(c1 - c0)
            crcs.append(c2 - c1)
    gib = total / (1 << 30)
    copy_s, crc_s = min(copies) / gib, min(crcs) / gib
    return {"copy_s_per_gib": copy_s, "crc_s_per_gib": crc_s, "limit_s_per_gib": copy_s + crc_s}


def cpu_per_gib(tr: Trainer, make: Callable[[], Saver], saves: int, tensors: list[torch.Tensor],
                rounds: int = 3) -> dict[str, Any]:
    """Back-to-back saves (one per optimizer step, no matmuls): process CPU seconds per GiB
    saved, less the optimizer step's and the state dict's own CPU (timed on this thread), in
    ``rounds`` rounds each after a one-pass limit measurement (:func:`one_pass_limit`), so that
    both see the same load on a shared host; ``x_one_pass`` is the ratio of the totals."""
    saver = make()
    limits: list[float] = []
    cpu = wall = 0.0
    n_saves = gib = 0.0
    try:
        for s in range(3):  # warm
            tr.opt.step()
            saver.after_step(s)
        saver.drain()
        s = 3
        for r in range(rounds):
            limits.append(one_pass_limit(tensors, repeat=1)["limit_s_per_gib"])
            saver.reset()
            user = 0.0
            c0, t0 = process_cpu_s(), time.perf_counter()
            for _ in range(max(1, saves // rounds)):
                u0 = time.thread_time()
                tr.opt.step()  # the guard's wait sleeps: no CPU of its own
                user += time.thread_time() - u0
                saver.after_step(s)
                s += 1
            saver.drain()
            cpu += process_cpu_s() - c0 - user
            wall += time.perf_counter() - t0
            n_saves += saver.saves
            gib += saver.bytes_saved / (1 << 30)
    finally:
        saver.close()
    per = cpu / gib if gib else None
    lim = statistics.median(limits)
    return {"saves": int(n_saves), "cpu_s": cpu, "wall_s": wall, "gib": gib, "cpu_s_per_gib": per,
            "cpu_s_per_save": cpu / max(n_saves, 1), "limit_s_per_gib": lim, "limits": limits,
            "x_one_pass": per / lim if per else None}
