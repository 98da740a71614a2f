"""One rank = one simulated node of test_fallback.py (peer restore falling back together).

argv: scenario base out. Env: ZEROSTALL_NODE, ZS_STEPS (save), ZS_GO (save: a file the rank
waits for before it closes, so the test can probe the live job), ZS_PT (peers.timeout_s),
ZS_STOP_SERVE (load: the node that SIGSTOPs itself when it first serves a restore).
Each node's root is ``base/<node>``; the c10d store is hosted by the test process.
"""

import json
import logging
import os
import sys
import time

import torch
import torch.distributed as dist

import zerostall
from zerostall import PeersConfig


def state_for(rank, step):
    g = torch.Generator().manual_seed(rank * 1000 + step)
    return {"w": torch.randn(64, 1024, generator=g), "meta": {"rank": rank, "step": step}}


def equal(a, b):
    return torch.equal(a["w"], b["w"]) and a["meta"] == b["meta"]


def main():
    scenario, base, out = sys.argv[1], sys.argv[2], sys.argv[3]
    node = os.environ["ZEROSTALL_NODE"]
    logging.basicConfig(level=logging.INFO, format=f"%(relativeCreated)d [{node}] %(message)s")
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    ck = zerostall.Checkpointer(os.path.join(base, node), dist_name="fallback-test", replicas=2,
                                peers=PeersConfig(timeout_s=float(os.environ.get("ZS_PT", 5))), commit_timeout_s=30,
                                close_timeout_s=4)
    res = {"rank": rank, "node": node}
    if scenario == "save":
        res["protected"] = {}
        for s in [int(x) for x in os.environ["ZS_STEPS"].split(",")]:
            h = ck.save(s, state_for(rank, s))
            h.result()
            h.wait(tier="peers", timeout=60)
            res["protected"][s] = h.protected()
        res["endpoint"] = ck._peers.describe()["endpoints"][node]
        with open(out + ".ready", "w") as f:
            json.dump(res, f)
        deadline = time.monotonic() + 120
        while not os.path.exists(os.environ["ZS_GO"]) and time.monotonic() < deadline:
            time.sleep(0.05)
    elif scenario == "load":
        if os.environ.get("ZS_STOP_SERVE") == node:  # the holder stops the first time it serves a restore
            import signal
            from zerostall.peers import stream
            fired = []

            def hook(point):
                if point == "serve:sending" and not fired:
                    fired.append(point)
                    open(out + ".stopped", "w").close()
                    os.kill(os.getpid(), signal.SIGSTOP)  # the test continues it, by pid
            stream.fault_hook = hook
        report = zerostall.LoadReport()
        state = state_for(rank, 0)
        try:
            ck.load(state, report=report)
            res["step"], res["source"], res["why"] = report.step, report.source, report.why
            res["equal"] = equal(state, state_for(rank, report.step))
        except zerostall.errors.ZerostallError as exc:
            res["error"], res["error_type"] = str(exc), type(exc).__name__
        dist.barrier()
    ck.close()
    with open(out, "w") as f:
        json.dump(res, f)
    dist.barrier()
    os._exit(0)


if __name__ == "__main__":
    main()
