"""One rank = one simulated node of the holder-housekeeping test (test_holders.py).

argv: scenario base out; env as peers_worker.py (ZEROSTALL_NODE, ...). Rank R's
root is ``base/root<R>`` whatever its node name; the last rank starts under the name of the
rank before it (its own root: a duplicate), then takes ``n<R>`` for the rest. One process
group runs three Checkpointers in turn on the same roots (three runs of the job, a restart
between each). load: a restart that loads (after the test deleted a step)."""

import json
import logging
import os
import sys
import time

import torch
import torch.distributed as dist

import zerostall
from helpers import equal
from adv_worker import state_for as frozen_state
from peers_worker import state_for
from zerostall import PeersConfig


def checkpointer(root, **kw):
    return zerostall.Checkpointer(root, dist_name="holders-test", replicas=2, commit_timeout_s=30,
                                  close_timeout_s=4, peers=PeersConfig(timeout_s=5, replica_timeout_s=30), **kw)


def held(root):
    """{src: [steps]} of the copies this root holds for other nodes."""
    area = os.path.join(root, "peers")
    out = {}
    for src in sorted(os.listdir(area)) if os.path.isdir(area) else []:
        if not src.startswith(".") and os.path.isdir(os.path.join(area, src)):
            out[src] = sorted(int(d[5:]) for d in os.listdir(os.path.join(area, src)) if d.startswith("step-"))
    return out


def saves(ck, rank, steps, res, key, state=state_for):
    for s in steps:
        h = ck.save(s, state(rank, s))
        h.result()
        h.wait(tier="peers", timeout=60)
        res.setdefault(key, {})[s] = h.protected()


def main():
    scenario, base, out = sys.argv[1], sys.argv[2], sys.argv[3]
    logging.basicConfig(level=logging.INFO, format=f"%(relativeCreated)d [{os.environ['ZEROSTALL_NODE']}] %(message)s")
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    root = os.path.join(base, f"root{rank}")
    res = {"rank": rank}
    if scenario == "holders":
        try:  # two ranks under one node name, separate roots
            checkpointer(root, keep_last=2).close()
            res["dup_error"] = None
        except zerostall.errors.ZerostallError as exc:
            res["dup_error"], res["dup_type"] = str(exc), type(exc).__name__
        os.environ["ZEROSTALL_NODE"] = f"n{rank}"
        dist.barrier()
        ck = checkpointer(root, keep_last=2)  # run 1
        saves(ck, rank, (1, 2, 3), res, "run1")
        ck.close()
        dist.barrier()
        ck = checkpointer(root, keep_last=2)  # run 2: a restart, then one more step
        saves(ck, rank, (4,), res, "run2")
        ck.close()
        dist.barrier()
        res["held_after_run2"] = held(root)
        dist.barrier()
        ck = checkpointer(root, keep_last=2, incremental="crc")  # run 3: incremental
        saves(ck, rank, (5, 6, 7), res, "run3", frozen_state)  # 6 and 7 reference 5's frozen tensor
        h = ck.save(8, frozen_state(rank, 8))
        h.result()
        res["watcher_alive"] = ck._peers.replicator._watch.is_alive()  # it ran step 7's retention by now
        h.wait(tier="peers", timeout=15)
        res["run3"][8] = h.protected()
        ck.close()
        dist.barrier()
        res["held_after_run3"] = held(root)
    elif scenario == "load":  # a restart after `zerostall delete` (the test ran it)
        os.environ["ZEROSTALL_NODE"] = f"n{rank}"
        ck = checkpointer(root, keep_last=2, incremental="crc")
        report = zerostall.LoadReport()
        state = frozen_state(rank + 100, 0)
        try:
            ck.load(state, report=report)
            res["step"], res["source"] = report.step, report.source
            res["equal"] = equal(state, frozen_state(rank, report.step))
        except zerostall.errors.ZerostallError as exc:
            res["error"] = str(exc)
        dist.barrier()
        ck.close()
        res["held"] = held(root)
    json.dump(res, open(out, "w"))
    if rank == 0:  # rank 0 hosts the c10d store: it leaves last
        others = [out.replace("-r0.json", f"-r{r}.json") for r in range(1, dist.get_world_size())]
        deadline = time.monotonic() + 60
        while not all(os.path.exists(o) for o in others) and time.monotonic() < deadline:
            time.sleep(0.05)
    os._exit(0)


if __name__ == "__main__":
    main()
