"""One rank = one simulated node of the coded-copy tests (run by test_coded_nodes.py).

argv: scenario base out. Env: ZEROSTALL_NODE (the node), ZS_K / ZS_M (RS(k, m)), ZS_DIE (save:
the rank that SIGKILLs itself once its steps are protected), ZS_REMOTE (a remote tier's URL:
save waits until each step is there too), ZS_WIPE (scenario "fallback": the nodes whose roots
are wiped after the save, before the job restarts twice in the same processes: once without the
remote tier, then with it). Each node's root is ``base/<node>``.
"""

import os
import shutil
import signal

import torch.distributed as dist

import zerostall
from workers import load_into, protect, report, start
from workers import checkpointer as _checkpointer
from workers import state_for as _state_for
from zerostall import PeersConfig


def state_for(rank, step):
    return _state_for(rank, step, rows=64, cols=1024 + 16 * rank)


def checkpointer(base, remote=None):
    peers = PeersConfig(timeout_s=5, replica_timeout_s=30, code="rs", data_fragments=int(os.environ["ZS_K"]),
                        parity_fragments=int(os.environ["ZS_M"]))
    return _checkpointer(os.path.join(base, os.environ["ZEROSTALL_NODE"]), "coded-test", peers, remote=remote)


def load(ck, rank, res):
    """Load the newest step every rank can into ``res`` (step, source, equal; or the error)."""
    load_into(ck, state_for(rank, 0), lambda step: state_for(rank, step), res)
    return res


def main():
    scenario, base, out, rank, node = start()
    res = {"rank": rank, "node": node}
    if scenario in ("save", "fallback"):
        ck = checkpointer(base, os.environ.get("ZS_REMOTE"))
        res["protected"], res["replica_nodes"] = {}, {}
        for s in (1, 2):
            h = protect(ck, s, state_for(rank, s))
            if os.environ.get("ZS_REMOTE"):
                res.setdefault("durable", {})[s] = h.wait(tier="remote", timeout=60)
            res["protected"][s] = h.protected()
            res["replica_nodes"][s] = list(h.result().replica_nodes)
        rep = ck._peers.replicator
        res["fragment_bytes_sent"], res["encode_cpu_s"] = rep.fragment_bytes_sent, rep.encode_cpu_s
        if str(rank) == os.environ.get("ZS_DIE"):
            report(res, out)
            os.kill(os.getpid(), signal.SIGKILL)  # the node dies: no close, no goodbye
        ck.close()
    elif scenario == "load":
        try:
            ck = checkpointer(base)
        except zerostall.errors.ZerostallError as exc:
            res["error"], res["error_type"] = str(exc), type(exc).__name__
            report(res, out)
            return
        load(ck, rank, res)
        res["repaired"] = ck._peers.replicator.repaired.wait(30)
        dist.barrier()  # no holder leaves before every node's repair pass is over
        ck.close()
    if scenario == "fallback":  # nodes replaced; the job restarted twice: without the remote tier, then with it
        dist.barrier()
        if node in os.environ["ZS_WIPE"].split(","):
            shutil.rmtree(os.path.join(base, node))
        dist.barrier()
        for key, remote in (("without", None), ("with", os.environ["ZS_REMOTE"])):
            ck = checkpointer(base, remote)
            res[key] = load(ck, rank, {})
            ck.close()
    report(res, out)


if __name__ == "__main__":
    main()
