"""One rank = one simulated node of test_peers.py (peer restore falling back together).

argv: scenario base out. Env: ZEROSTALL_NODE, ZS_STEPS (save), ZS_GO (save: a file the rank
waits for before it closes, so the test can probe the live job), ZS_PT (peers.timeout_s),
ZS_STOP_SERVE (load: the node that SIGSTOPs itself when it first serves a restore).
Each node's root is ``base/<node>``; the c10d store is hosted by the test process.
"""

import json
import os
import signal
import time

import torch.distributed as dist

from workers import checkpointer, load_into, report, save_steps, start
from workers import state_for as _state_for
from zerostall import PeersConfig


def state_for(rank, step):
    return _state_for(rank, step, rows=64, bias=False)


def _stop_at_first_serve(out):
    """The holder SIGSTOPs itself the first time it sends a restore's bytes."""
    from zerostall.peers import stream
    fired = []

    def hook(point):
        if point == "serve:sending" and not fired:
            fired.append(point)
            open(out + ".stopped", "w").close()
            os.kill(os.getpid(), signal.SIGSTOP)  # the test continues it, by pid
    stream.fault_hook = hook


def main():
    scenario, base, out, rank, node = start()
    peers = PeersConfig(timeout_s=float(os.environ.get("ZS_PT", 5)))
    if scenario == "load" and os.environ.get("ZS_STOP_SERVE") == node:
        _stop_at_first_serve(out)  # before the Checkpointer: its peer server serves from its start
    ck = checkpointer(os.path.join(base, node), "fallback-test", peers, replicas=2)
    res = {"rank": rank, "node": node}
    if scenario == "save":
        res["protected"] = {}
        save_steps(ck, rank, [int(x) for x in os.environ["ZS_STEPS"].split(",")], res, state_for)
        res["endpoint"] = ck._peers.describe()["endpoints"][node]
        with open(out + ".ready", "w") as f:
            json.dump(res, f)
        deadline = time.monotonic() + 120
        while not os.path.exists(os.environ["ZS_GO"]) and time.monotonic() < deadline:
            time.sleep(0.05)
    elif scenario == "load":
        load_into(ck, state_for(rank, 0), lambda step: state_for(rank, step), res)
        dist.barrier()
    ck.close()
    report(res, out)
    dist.barrier()
    os._exit(0)


if __name__ == "__main__":
    main()
