"""Warm staging speed: the snapshot thread's copy alone vs one single-threaded memmove.

Stages a GPT-style state (many tensors of mixed sizes) into a warm, pre-faulted staging ring
with a consumer that releases blocks as soon as they are staged (no disk, no crc32c), and
compares with one ``memmove`` of the same number of bytes between two warm buffers.
Usage: python bench/scripts/staging_copy.py [--size-mib 1024] [--repeat 5] [--json out.json]
"""

from __future__ import annotations

import argparse
import ctypes
import json
import statistics
import threading
import time

import torch

from zerostall_bench.model import gpt_state_for_size
from zerostall.memory.arena import Arena
from zerostall.saving.job import Job, SaveRequest, SaveStatus, Slot, Source
from zerostall.saving.plan import build_plan
from zerostall.memory.ring import BlockRing
from zerostall.saving.snapshot import Snapshotter


def stage_once(snap: Snapshotter, ring: BlockRing, arena: Arena, state) -> float:
    plan = build_plan(state)
    nblocks = ring.blocks_for(plan.file_bytes)
    slot = Slot(ring.reserve(nblocks), nblocks, arena)
    leaves = [leaf.tensor for leaf in plan.leaves]
    job = Job(SaveRequest(step=0, plan=plan), SaveStatus(), slot, Source(leaves))

    def drain():
        g = slot.g0
        while g < slot.g_end:
            hi = min(ring.wait_staged(g), slot.g_end)
            ring.release(g, hi)
            g = hi

    d = threading.Thread(target=drain)
    d.start()
    t0 = time.perf_counter()
    snap.submit(job)
    job.status.staged.wait()
    t = time.perf_counter() - t0
    d.join()
    if job.status.error:
        raise job.status.error
    return t


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--size-mib", type=int, default=1024)
    p.add_argument("--repeat", type=int, default=5)
    p.add_argument("--block-mib", type=int, default=8)
    p.add_argument("--json", default=None)
    a = p.parse_args()
    torch.set_num_threads(1)
    state = gpt_state_for_size(a.size_mib << 20)
    plan = build_plan(state)
    nbytes = plan.payload_bytes
    arena = Arena(2 * plan.file_bytes + (a.block_mib << 20), mlock=False)
    ring = BlockRing(arena.nbytes, a.block_mib << 20)
    snap = Snapshotter(arena, ring)
    src = torch.empty(nbytes, dtype=torch.uint8).fill_(1)  # warm, like the state's tensors
    dst = torch.empty(nbytes, dtype=torch.uint8).fill_(2)
    mm, st = [], []
    stage_once(snap, ring, arena, state)  # first lap: faults nothing (pre-faulted) but warms caches/TLB
    for _ in range(a.repeat):  # interleaved, so both see the same machine load
        t0 = time.perf_counter()
        ctypes.memmove(dst.data_ptr(), src.data_ptr(), nbytes)
        mm.append(time.perf_counter() - t0)
        st.append(stage_once(snap, ring, arena, state))
    snap.stop()
    out = {"bytes": nbytes, "tensors": len(plan.items), "block_bytes": a.block_mib << 20,
           "memmove_s_min": min(mm), "memmove_s_median": statistics.median(mm),
           "stage_s_min": min(st), "stage_s_median": statistics.median(st),
           "ratio_min": min(st) / min(mm), "ratio_median": statistics.median(st) / statistics.median(mm)}
    print(json.dumps(out, indent=1))
    if a.json:
        with open(a.json, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
