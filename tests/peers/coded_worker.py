"""One rank = one simulated node of the coded-copy tests (run by test_coded_nodes.py).

argv: scenario base out. Env: ZEROSTALL_NODE (the node), ZS_K / ZS_M (RS(k, m)), ZS_DIE (save:
the rank that SIGKILLs itself once its steps are protected). Each node's root is ``base/<node>``.
"""

import json
import logging
import os
import signal
import sys

import torch
import torch.distributed as dist

import zerostall
from helpers import equal
from zerostall import PeersConfig


def state_for(rank, step):
    g = torch.Generator().manual_seed(rank * 1000 + step)
    return {"w": torch.randn(64, 1024 + 16 * rank, generator=g), "b": torch.randn(257, generator=g).to(torch.bfloat16),
            "meta": {"rank": rank, "step": step}}


def checkpointer(base):
    node = os.environ["ZEROSTALL_NODE"]
    peers = PeersConfig(timeout_s=5, replica_timeout_s=30, code="rs", data_fragments=int(os.environ["ZS_K"]),
                        parity_fragments=int(os.environ["ZS_M"]))
    return zerostall.Checkpointer(os.path.join(base, node), dist_name="coded-test", peers=peers, commit_timeout_s=30,
                                  close_timeout_s=4)


def main():
    scenario, base, out = sys.argv[1], sys.argv[2], sys.argv[3]
    logging.basicConfig(level=logging.INFO, format=f"%(relativeCreated)d [{os.environ['ZEROSTALL_NODE']}] %(message)s")
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    res = {"rank": rank, "node": os.environ["ZEROSTALL_NODE"]}
    if scenario == "save":
        ck = checkpointer(base)
        res["protected"], res["replica_nodes"] = {}, {}
        for s in (1, 2):
            h = ck.save(s, state_for(rank, s))
            h.result()
            h.wait(tier="peers", timeout=60)
            res["protected"][s] = h.protected()
            res["replica_nodes"][s] = list(h.result().replica_nodes)
        rep = ck._peers.replicator
        res["fragment_bytes_sent"], res["encode_cpu_s"] = rep.fragment_bytes_sent, rep.encode_cpu_s
        if str(rank) == os.environ.get("ZS_DIE"):
            json.dump(res, open(out, "w"))
            os.kill(os.getpid(), signal.SIGKILL)  # the node dies: no close, no goodbye
        ck.close()
    elif scenario == "load":
        try:
            ck = checkpointer(base)
        except zerostall.errors.ZerostallError as exc:
            res["error"], res["error_type"] = str(exc), type(exc).__name__
            json.dump(res, open(out, "w"))
            return
        report = zerostall.LoadReport()
        state = state_for(rank, 0)
        try:
            ck.load(state, report=report)
            res["step"], res["source"] = report.step, report.source
            res["equal"] = equal(state, state_for(rank, report.step))
        except zerostall.errors.ZerostallError as exc:
            res["error"], res["error_type"] = str(exc), type(exc).__name__
        res["repaired"] = ck._peers.replicator.repaired.wait(30)
        dist.barrier()  # no holder leaves before every node's repair pass is over
        ck.close()
    json.dump(res, open(out, "w"))


if __name__ == "__main__":
    main()
