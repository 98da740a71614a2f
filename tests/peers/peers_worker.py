"""One rank = one simulated node of the peer-replica tests (run by test_peers.py).

argv: scenario base out. Env: ZEROSTALL_NODE (the node), ZS_REPLICAS, ZS_STEPS, ZS_REMOTE (a
file:// URL or empty), ZS_QUOTA (peers.quota_bytes), ZS_DIE (save: the rank that SIGKILLs itself once its steps are
protected), ZS_STOP (stop: the rank that SIGSTOPs itself after its commit of the last step),
ZS_KILL / ZS_KILL_AT (kill: the rank that SIGKILLs itself at that peer-transfer state of step 2),
ZS_STOP_RANK / ZS_STOP_AT (stopat: the rank that SIGSTOPs itself at that state of step 2; the
test continues it).
Each node's root is ``base/<node>``.
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
from zerostall import PeersConfig


def state_for(rank, step):
    g = torch.Generator().manual_seed(rank * 1000 + step)
    return {"w": torch.randn(256, 1024, generator=g), "b": torch.randn(257, generator=g).to(torch.bfloat16),
            "meta": {"rank": rank, "step": step}}


def checkpointer(base, **kw):
    node = os.environ["ZEROSTALL_NODE"]
    remote = os.environ.get("ZS_REMOTE") or None
    quota = int(os.environ["ZS_QUOTA"]) if os.environ.get("ZS_QUOTA") else None
    peers = PeersConfig(timeout_s=float(os.environ.get("ZS_PT", 5)), replica_timeout_s=float(os.environ.get("ZS_RT", 30)),
                        quota_bytes=quota)
    return zerostall.Checkpointer(os.path.join(base, node), dist_name="peers-test", replicas=int(os.environ["ZS_REPLICAS"]),
                                  peers=peers,
                                  remote=remote, commit_timeout_s=30, close_timeout_s=4, **kw)


def main():
    scenario, base, out = sys.argv[1], sys.argv[2], sys.argv[3]
    logging.basicConfig(level=logging.INFO, format=f"%(relativeCreated)d [{os.environ['ZEROSTALL_NODE']}] %(message)s")
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    res = {"rank": rank, "node": os.environ["ZEROSTALL_NODE"]}
    steps = [int(s) for s in os.environ.get("ZS_STEPS", "1,2").split(",")]
    if scenario == "save":
        ck = checkpointer(base)
        res["protected"], res["replica_nodes"] = {}, {}
        for s in steps:
            h = ck.save(s, state_for(rank, s))
            h.result()
            h.wait(tier="peers", timeout=60)
            if os.environ.get("ZS_REMOTE"):
                h.wait(tier="remote", timeout=60)
            res["protected"][s] = h.protected()
            res["replica_nodes"][s] = list(h.result().replica_nodes)
            res.setdefault("durable", {})[s] = h.durable()
        res["unprotected_error"] = ck._peers.status(steps[-1]).error
        if str(rank) == os.environ.get("ZS_DIE"):
            json.dump(res, open(out, "w"))
            os.kill(os.getpid(), signal.SIGKILL)  # the node dies: no close, no goodbye
        ck.close()
    elif scenario == "load":
        ck = checkpointer(base)
        report = zerostall.LoadReport()
        state = state_for(rank, 0)
        try:
            ck.load(state, report=report)
            res["step"], res["source"] = report.step, report.source
            res["equal"] = equal(state, state_for(rank, report.step))
        except zerostall.errors.ZerostallError as exc:
            res["error"], res["error_type"] = str(exc), type(exc).__name__
        res["repaired"] = ck._peers.replicator.repaired.wait(30)
        # no node closes (its server with it) before every node's repair pass is over: a
        # holder that left early would cut the others' repairs to it (the next start would
        # finish them; the test checks this run's)
        dist.barrier()
        ck.close()
    elif scenario == "kill":  # step 1 protected, then rank ZS_KILL SIGKILLs itself at ZS_KILL_AT during step 2's copies
        from zerostall.peers import stream
        ck = checkpointer(base)
        res["protected"], res["replica_nodes"] = {}, {}
        for s in (1, 2):
            if s == 2 and rank == int(os.environ["ZS_KILL"]):
                point = os.environ["ZS_KILL_AT"]
                stream.fault_hook = lambda p: os.kill(os.getpid(), signal.SIGKILL) if p == point else None
            h = ck.save(s, state_for(rank, s))
            h.result()
            h.wait(tier="peers", timeout=60)
            res["protected"][s] = h.protected()
            res["replica_nodes"][s] = list(h.result().replica_nodes)
        ck.close()
    elif scenario == "stopat":  # step 1 protected; rank ZS_STOP_RANK SIGSTOPs itself at ZS_STOP_AT in step 2's copies
        from zerostall.peers import stream
        ck = checkpointer(base)
        res["protected"], res["replica_nodes"], res["durable"] = {}, {}, {}
        for s in (1, 2):
            if s == 2 and rank == int(os.environ["ZS_STOP_RANK"]):
                point, fired = os.environ["ZS_STOP_AT"], []

                def hook(p, point=point, fired=fired):
                    if p == point and not fired:  # once: the state the test sweeps
                        fired.append(p)
                        os.kill(os.getpid(), signal.SIGSTOP)
                stream.fault_hook = hook
            h = ck.save(s, state_for(rank, s))
            h.result()
            if s == 2:
                x = torch.zeros(1)
                for _ in range(20):  # "training" goes on while copies to or from the stopped node time out
                    x += 1
                    time.sleep(0.05)
                res["trained"] = int(x.item())
            h.wait(tier="peers", timeout=60)
            res["protected"][s] = h.protected()
            res["replica_nodes"][s] = list(h.result().replica_nodes)
            res["durable"][s] = h.durable()
        t0 = time.monotonic()
        ck.close()
        res["close_s"] = time.monotonic() - t0
        res["unprotected"] = ck.unprotected
    elif scenario == "stop":
        ck = checkpointer(base)
        stopper = int(os.environ["ZS_STOP"])
        for s in steps:
            h = ck.save(s, state_for(rank, s))
            h.result()
            if s != steps[-1]:
                h.wait(tier="peers", timeout=60)
        if rank == stopper:
            os.kill(os.getpid(), signal.SIGSTOP)  # the test SIGKILLs us once the others are done
        t0 = time.monotonic()
        x = torch.zeros(1)
        for _ in range(20):  # "training" goes on while copies to the stopped node time out
            x += 1
            time.sleep(0.05)
        res["trained"] = int(x.item())
        res["train_s"] = time.monotonic() - t0
        h.wait(tier="peers", timeout=60)
        res["last_protected"] = h.protected()
        res["last_durable"] = h.durable()
        t0 = time.monotonic()
        ck.close()
        res["close_s"] = time.monotonic() - t0
        res["unprotected"] = ck.unprotected
    json.dump(res, open(out, "w"))
    if rank == 0:  # rank 0 hosts the c10d store: it leaves last (a stopped rank never finishes)
        others = [out.replace("-r0.json", f"-r{r}.json") for r in range(1, dist.get_world_size())
                  if str(r) not in (os.environ.get("ZS_STOP"), os.environ.get("ZS_KILL"))]
        deadline = time.monotonic() + 120
        while not all(os.path.exists(o) for o in others) and time.monotonic() < deadline:
            time.sleep(0.05)
    os._exit(0)  # not destroy_process_group: a stopped or dead peer must not hold our exit


if __name__ == "__main__":
    main()
