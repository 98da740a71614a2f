"""One rank = one simulated node of the holder-housekeeping test (test_holders.py).

argv: scenario base out; env as peers_worker.py (ZEROSTALL_NODE, ...). Rank R's
root is ``base/root<R>`` whatever its node name; the last rank starts under the name of the
rank before it (its own root: a duplicate), then takes ``n<R>`` for the rest. One process
group runs three Checkpointers in turn on the same roots (three runs of the job, a restart
between each). load: a restart that loads (after the test deleted a step)."""

import os

import torch.distributed as dist

import zerostall
from workers import checkpointer as _checkpointer
from workers import frozen_state, leave, load_into, report, save_steps, start
from zerostall import PeersConfig


def checkpointer(root, **kw):
    return _checkpointer(root, "holders-test", PeersConfig(timeout_s=5, replica_timeout_s=30), replicas=2, **kw)


def held(root):
    """{src: [steps]} of the copies this root holds for other nodes."""
    area = os.path.join(root, "peers")
    out = {}
    for src in sorted(os.listdir(area)) if os.path.isdir(area) else []:
        if not src.startswith(".") and os.path.isdir(os.path.join(area, src)):
            out[src] = sorted(int(d[5:]) for d in os.listdir(os.path.join(area, src)) if d.startswith("step-"))
    return out


def main():
    scenario, base, out, rank, _ = start()
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
        save_steps(ck, rank, (1, 2, 3), res, key="run1")
        ck.close()
        dist.barrier()
        ck = checkpointer(root, keep_last=2)  # run 2: a restart, then one more step
        save_steps(ck, rank, (4,), res, key="run2")
        ck.close()
        dist.barrier()
        res["held_after_run2"] = held(root)
        dist.barrier()
        ck = checkpointer(root, keep_last=2, incremental="crc")  # run 3: incremental
        save_steps(ck, rank, (5, 6, 7), res, frozen_state, key="run3")  # 6 and 7 reference 5's frozen tensor
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
        load_into(ck, frozen_state(rank + 100, 0), lambda step: frozen_state(rank, step), res)
        dist.barrier()
        ck.close()
        res["held"] = held(root)
    report(res, out)
    leave(out)


if __name__ == "__main__":
    main()
