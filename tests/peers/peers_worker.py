"""One rank = one simulated node of the peer-replica tests (run by test_peers.py).

argv: scenario base out. Env: ZEROSTALL_NODE (the node), ZS_REPLICAS, ZS_STEPS, ZS_REMOTE (a
file:// URL or empty), ZS_QUOTA (peers.quota_bytes), ZS_DIE (save: the rank that SIGKILLs itself once its steps are
protected), ZS_STOP (stop: the rank that SIGSTOPs itself after its commit of the last step),
ZS_KILL / ZS_KILL_AT (kill: the rank that SIGKILLs itself at that peer-transfer state of step 2),
ZS_STOP_RANK / ZS_STOP_AT (stopat: the rank that SIGSTOPs itself at that state of step 2; the
test continues it).
Each node's root is ``base/<node>`` (:func:`workers.env_checkpointer`).
"""

import os
import signal
import time

import torch
import torch.distributed as dist

from workers import env_checkpointer, leave, load_into, protect, report, save_steps, start, state_for


def main():
    scenario, base, out, rank, node = start()
    res = {"rank": rank, "node": node}
    steps = [int(s) for s in os.environ.get("ZS_STEPS", "1,2").split(",")]
    if scenario == "save":
        ck = env_checkpointer(base)
        res["protected"], res["replica_nodes"] = {}, {}
        for s in steps:
            h = protect(ck, s, state_for(rank, s))
            if os.environ.get("ZS_REMOTE"):
                h.wait(tier="remote", timeout=60)
            res["protected"][s] = h.protected()
            res["replica_nodes"][s] = list(h.result().replica_nodes)
            res.setdefault("durable", {})[s] = h.durable()
        res["unprotected_error"] = ck._peers.status(steps[-1]).error
        if str(rank) == os.environ.get("ZS_DIE"):
            report(res, out)
            os.kill(os.getpid(), signal.SIGKILL)  # the node dies: no close, no goodbye
        ck.close()
    elif scenario == "load":
        ck = env_checkpointer(base)
        load_into(ck, state_for(rank, 0), lambda step: state_for(rank, step), res)
        res["repaired"] = ck._peers.replicator.repaired.wait(30)
        # no node closes (its server with it) before every node's repair pass is over: a
        # holder that left early would cut the others' repairs to it (the next start would
        # finish them; the test checks this run's)
        dist.barrier()
        ck.close()
    elif scenario == "kill":  # step 1 protected, then rank ZS_KILL SIGKILLs itself at ZS_KILL_AT during step 2's copies
        from zerostall.peers import stream
        ck = env_checkpointer(base)
        save_steps(ck, rank, (1,), res, nodes=True)
        if rank == int(os.environ["ZS_KILL"]):
            point = os.environ["ZS_KILL_AT"]
            stream.fault_hook = lambda p: os.kill(os.getpid(), signal.SIGKILL) if p == point else None
        save_steps(ck, rank, (2,), res, nodes=True)
        ck.close()
    elif scenario == "stopat":  # step 1 protected; rank ZS_STOP_RANK SIGSTOPs itself at ZS_STOP_AT in step 2's copies
        from zerostall.peers import stream
        ck = env_checkpointer(base)
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
        ck = env_checkpointer(base)
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
    report(res, out)
    # a stopped rank never finishes
    leave(out, absent=[int(os.environ[k]) for k in ("ZS_STOP", "ZS_KILL") if os.environ.get(k)], wait_s=120)


if __name__ == "__main__":
    main()
