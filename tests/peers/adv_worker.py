"""One rank = one simulated node of adv1's peer-replica checks (run by test_adv_peers.py).

argv: scenario base out. Env as peers_worker.py (ZEROSTALL_NODE, ZS_REPLICAS, ZS_STEPS) plus
ZS_KW: extra Checkpointer keywords as JSON (e.g. {"incremental": true}); ZS_KILL_RANK and
ZS_KILL_STEP: that rank's node dies (SIGKILL, at the transport seam) as it starts copying that
step to a peer, i.e. right after the step committed everywhere. The state has a
tensor that never changes (``frozen``: an incremental step references it) and one that does.
"""

import json
import logging
import os
import signal
import sys
import time

import torch
import torch.distributed as dist

import zerostall
from helpers import equal
from peers_worker import checkpointer


_FROZEN = {}


def state_for(rank, step):
    """The same ``frozen`` tensor object every time (an incremental save references it)."""
    g = torch.Generator().manual_seed(rank * 1000 + step)
    if rank not in _FROZEN:
        _FROZEN[rank] = torch.randn(256, 1024, generator=torch.Generator().manual_seed(rank))
    return {"frozen": _FROZEN[rank], "w": torch.randn(64, 1024, generator=g), "meta": {"rank": rank, "step": step}}


def main():
    scenario, base, out = sys.argv[1], sys.argv[2], sys.argv[3]
    logging.basicConfig(level=logging.INFO, format=f"%(relativeCreated)d [{os.environ['ZEROSTALL_NODE']}] %(message)s")
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    kw = json.loads(os.environ.get("ZS_KW", "{}"))
    res = {"rank": rank, "node": os.environ["ZEROSTALL_NODE"]}
    kill = int(os.environ.get("ZS_KILL_RANK", -1))
    if rank == kill:
        from zerostall.peers.tcp import TcpTransport
        put = TcpTransport.put

        def dying_put(self, ep, src, step, *a, **k):
            if step == int(os.environ["ZS_KILL_STEP"]):
                json.dump(res, open(out, "w"))
                os.kill(os.getpid(), signal.SIGKILL)
            return put(self, ep, src, step, *a, **k)
        TcpTransport.put = dying_put
    ck = checkpointer(base, **kw)
    if scenario == "save":
        res["protected"] = {}
        for s in [int(s) for s in os.environ.get("ZS_STEPS", "1,2").split(",")]:
            h = ck.save(s, state_for(rank, s))
            h.result()
            h.wait(tier="peers", timeout=60)
            res["protected"][s] = h.protected()
    elif scenario == "load":
        report = zerostall.LoadReport()
        state = state_for(rank + 100, 0)
        try:
            ck.load(state, report=report)
            res["step"], res["source"] = report.step, report.source
            res["equal"] = equal(state, state_for(rank, report.step))
        except zerostall.errors.ZerostallError as exc:
            res["error"], res["error_type"] = str(exc), type(exc).__name__
    ck.close()
    json.dump(res, open(out, "w"))
    if rank == 0:  # rank 0 hosts the c10d store: it leaves last
        others = [out.replace("-r0.json", f"-r{r}.json") for r in range(1, dist.get_world_size()) if r != kill]
        deadline = time.monotonic() + 60
        while not all(os.path.exists(o) for o in others) and time.monotonic() < deadline:
            time.sleep(0.05)
    os._exit(0)


if __name__ == "__main__":
    main()
