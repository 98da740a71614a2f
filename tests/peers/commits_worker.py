"""One rank = one simulated node of test_commits.py (copies tied to their commit).

argv: scenario base out; env as peers_worker.py. Node ``n<i>``'s root is ``base/n<i>``.
overwrite: steps 1 and 2 saved and protected; the holder of n0's step 2 sets its copy aside;
step 2 saved again (``overwrite=True``, other values) and protected; then that holder puts the
superseded copy back (as if the overwrite's copy had never reached it). load: every rank loads
and says which step, from where, and whether the values are that step's last commit.
"""

import json
import logging
import os
import shutil
import sys
import time

import torch.distributed as dist

import zerostall
from helpers import equal
from peers_worker import checkpointer, state_for


def committed_state(rank, step):
    """The values of ``step``'s last commit (step 2 was overwritten with another seed)."""
    return state_for(rank + 50, step) if step == 2 else state_for(rank, step)


def main():
    scenario, base, out = sys.argv[1], sys.argv[2], sys.argv[3]
    me = os.environ["ZEROSTALL_NODE"]
    logging.basicConfig(level=logging.INFO, format=f"%(relativeCreated)d [{me}] %(message)s")
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    res = {"rank": rank, "node": me}
    ck = checkpointer(base)
    if scenario == "overwrite":
        res["protected"] = {}
        for s, st in ((1, state_for(rank, 1)), (2, state_for(rank, 2)), (2, committed_state(rank, 2))):
            h = ck.save(s, st, overwrite=s == 2 and "2" in res["protected"])
            h.result()
            h.wait(tier="peers", timeout=60)
            res["protected"][str(s)] = res["protected"].get(str(s), []) + [h.protected()]
            copy = os.path.join(base, me, "peers", "n0", "step-2")
            if s == 2 and len(res["protected"]["2"]) == 1 and os.path.isdir(copy):
                shutil.copytree(copy, os.path.join(base, "superseded"))
                res["set_aside"] = True
            dist.barrier()
        ck.close()
        dist.barrier()
        if res.get("set_aside"):
            shutil.rmtree(copy)
            shutil.copytree(os.path.join(base, "superseded"), copy)
    elif scenario == "load":
        report = zerostall.LoadReport()
        state = state_for(rank + 100, 0)
        try:
            ck.load(state, report=report)
            res["step"], res["source"] = report.step, report.source
            res["equal"] = equal(state, committed_state(rank, report.step))
        except zerostall.errors.ZerostallError as exc:
            res["error"], res["error_type"] = str(exc), type(exc).__name__
        dist.barrier()
        ck.close()
    json.dump(res, open(out, "w"))
    if rank == 0:  # rank 0 hosts the c10d store: it leaves last
        others = [out.replace("-r0.json", f"-r{r}.json") for r in range(1, dist.get_world_size())]
        deadline = time.monotonic() + 60
        while not all(os.path.exists(o) for o in others) and time.monotonic() < deadline:
            time.sleep(0.05)
    os._exit(0)


if __name__ == "__main__":
    main()
