"""One rank = one simulated node of the coded-copy tests (run by test_coded_nodes.py).

argv: scenario base out. Env: ZEROSTALL_NODE (the node), ZS_K / ZS_M (RS(k, m)), ZS_DIE (save:
the rank that SIGKILLs itself once its steps are protected), ZS_REMOTE (a remote tier's URL:
save waits until each step is there too), ZS_WIPE (scenario "fallback": the nodes whose roots
are wiped after the save, before the job restarts twice in the same processes: once without the
remote tier, then with it). Each node's root is ``base/<node>``.
"""

import json
import logging
import os
import shutil
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


def checkpointer(base, remote=None):
    node = os.environ["ZEROSTALL_NODE"]
    peers = PeersConfig(timeout_s=5, replica_timeout_s=30, code="rs", data_fragments=int(os.environ["ZS_K"]),
                        parity_fragments=int(os.environ["ZS_M"]))
    return zerostall.Checkpointer(os.path.join(base, node), dist_name="coded-test", peers=peers, commit_timeout_s=30,
                                  close_timeout_s=4, remote=remote)


def load(ck, rank, res):
    """Load the newest step every rank can into ``res`` (step, source, equal; or the error)."""
    report = zerostall.LoadReport()
    state = state_for(rank, 0)
    try:
        ck.load(state, report=report)
        res["step"], res["source"] = report.step, report.source
        res["equal"] = equal(state, state_for(rank, report.step))
    except zerostall.errors.ZerostallError as exc:
        res["error"], res["error_type"] = str(exc), type(exc).__name__
    return res


def main():
    scenario, base, out = sys.argv[1], sys.argv[2], sys.argv[3]
    logging.basicConfig(level=logging.INFO, format=f"%(relativeCreated)d [{os.environ['ZEROSTALL_NODE']}] %(message)s")
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    res = {"rank": rank, "node": os.environ["ZEROSTALL_NODE"]}
    if scenario in ("save", "fallback"):
        ck = checkpointer(base, os.environ.get("ZS_REMOTE"))
        res["protected"], res["replica_nodes"] = {}, {}
        for s in (1, 2):
            h = ck.save(s, state_for(rank, s))
            h.result()
            h.wait(tier="peers", timeout=60)
            if os.environ.get("ZS_REMOTE"):
                res.setdefault("durable", {})[s] = h.wait(tier="remote", timeout=60)
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
        load(ck, rank, res)
        res["repaired"] = ck._peers.replicator.repaired.wait(30)
        dist.barrier()  # no holder leaves before every node's repair pass is over
        ck.close()
    if scenario == "fallback":  # nodes replaced; the job restarted twice: without the remote tier, then with it
        dist.barrier()
        if res["node"] in os.environ["ZS_WIPE"].split(","):
            shutil.rmtree(os.path.join(base, res["node"]))
        dist.barrier()
        for key, remote in (("without", None), ("with", os.environ["ZS_REMOTE"])):
            ck = checkpointer(base, remote)
            res[key] = load(ck, rank, {})
            ck.close()
    json.dump(res, open(out, "w"))


if __name__ == "__main__":
    main()
