"""One rank = one simulated node of the coded-copy tests (run by test_coded_nodes.py).

argv: scenario base out. Env: ZEROSTALL_NODE (the node), ZS_K / ZS_M (RS(k, m)), ZS_DIE (save:
the rank that SIGKILLs itself once its steps are protected). Each node's root is ``base/<node>``.
"""

import os
import signal

import torch.distributed as dist

import zerostall
from workers import load_into, report, save_steps, start
from workers import checkpointer as _checkpointer
from workers import state_for as _state_for
from zerostall import PeersConfig


def state_for(rank, step):
    return _state_for(rank, step, rows=64, cols=1024 + 16 * rank)


def checkpointer(base):
    peers = PeersConfig(timeout_s=5, replica_timeout_s=30, code="rs", data_fragments=int(os.environ["ZS_K"]),
                        parity_fragments=int(os.environ["ZS_M"]))
    return _checkpointer(os.path.join(base, os.environ["ZEROSTALL_NODE"]), "coded-test", peers)


def main():
    scenario, base, out, rank, node = start()
    res = {"rank": rank, "node": node}
    if scenario == "save":
        ck = checkpointer(base)
        res["protected"], res["replica_nodes"] = {}, {}
        save_steps(ck, rank, (1, 2), res, state_for, nodes=True)
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
        load_into(ck, state_for(rank, 0), lambda step: state_for(rank, step), res)
        res["repaired"] = ck._peers.replicator.repaired.wait(30)
        dist.barrier()  # no holder leaves before every node's repair pass is over
        ck.close()
    report(res, out)


if __name__ == "__main__":
    main()
