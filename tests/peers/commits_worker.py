"""One rank = one simulated node of test_peers.py (copies tied to their commit).

argv: scenario base out; env as peers_worker.py. Node ``n<i>``'s root is ``base/n<i>``.
overwrite: steps 1 and 2 saved and protected; the holder of n0's step 2 sets its copy aside;
step 2 saved again (``overwrite=True``, other values) and protected; then that holder puts the
superseded copy back (as if the overwrite's copy had never reached it). load: every rank loads
and says which step, from where, and whether the values are that step's last commit.
"""

import os
import shutil

import torch.distributed as dist

from workers import env_checkpointer, leave, load_into, protect, report, start, state_for


def committed_state(rank, step):
    """The values of ``step``'s last commit (step 2 was overwritten with another seed)."""
    return state_for(rank + 50, step) if step == 2 else state_for(rank, step)


def main():
    scenario, base, out, rank, me = start()
    res = {"rank": rank, "node": me}
    ck = env_checkpointer(base)
    if scenario == "overwrite":
        res["protected"] = {}
        for s, st in ((1, state_for(rank, 1)), (2, state_for(rank, 2)), (2, committed_state(rank, 2))):
            h = protect(ck, s, st, overwrite=s == 2 and "2" in res["protected"])
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
        load_into(ck, state_for(rank + 100, 0), lambda step: committed_state(rank, step), res)
        dist.barrier()
        ck.close()
    report(res, out)
    leave(out)


if __name__ == "__main__":
    main()
