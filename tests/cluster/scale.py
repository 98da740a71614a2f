"""Scale on one machine: an N-node job (default 16) on the namespace cluster, small states, one
rank per node, ``replicas=2``; timed from its events log (:mod:`.node_worker`):

1. the commit rounds of steps 1 and 2 (from the first rank's ``save()`` to the last rank's
   handle durable) and protection (to the last rank's peer stage done);
2. placement balance: how many other nodes' copies each node holds (rendezvous hashing);
3. node n5 lost (root wiped) and replaced: the restarted job's agreement and load (n5's
   files from its holders), and the repair pass that copies the other nodes' kept steps back
   onto the replacement as a holder (until every node's pass is over).

Not in CI (minutes on a small machine)::

    PYTHONPATH=$PWD/src python -m tests.cluster.scale --nodes 16 [--launcher torchrun]
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import platform
import shutil
import sys
import tempfile
import time
from typing import Any

from .harness import Cluster, unavailable
from .job import Job, of


def _span(ev: list[dict[str, Any]], start: str, end: str, step: int) -> float:
    a = [e["t"] for e in of(ev, start, step=step)]
    b = [e["t"] for e in of(ev, end, step=step)]
    return max(b) - min(a)


def run(n: int, work: str, launcher: str = "bare", mib: float = 1.0) -> dict[str, Any]:
    why = unavailable()
    if why:
        raise SystemExit(f"scale: {why}")
    env = {"ZS_REPLICAS": "2", "ZS_STEPS": "1,2", "ZS_MIB": str(mib), "ZS_PT": "10", "ZS_RT": "120",
           "ZS_CT": "120", "ZS_JT": "600"}
    with Cluster(n, base=os.path.join(work, "cluster")) as c:
        t0 = time.monotonic()
        save = Job(c, os.path.join(work, "save"), "save", env, launcher=launcher)
        codes = save.wait(1800)
        if codes != [0] * n:
            raise SystemExit(f"scale: the save run failed: {codes}\n{save.tail(1500)}")
        save_wall = time.monotonic() - t0
        ev = save.events()
        out: dict[str, Any] = {"nodes": n, "mib_per_node": mib, "launcher": launcher,
                               "machine": f"{platform.node()} {os.cpu_count()} CPUs, {platform.release()}",
                               "date_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                               "load_avg_start": os.getloadavg(), "save_run_s": save_wall,
                               "start_s": max(e["t"] for e in of(ev, "serving")) - min(e["t"] for e in of(ev, "launch"))}
        for s in (1, 2):
            out[f"commit_s_step{s}"] = _span(ev, "saving", "done", s)
            out[f"protected_s_step{s}"] = _span(ev, "saving", "peers-done", s)
            out[f"durable_step{s}"] = all(e["durable"] for e in of(ev, "done", step=s)) and len(of(ev, "done", step=s)) == n
            out[f"protected_step{s}"] = all(e["protected"] for e in of(ev, "peers-done", step=s))
        held = collections.Counter()
        for nd in c.nodes:
            pdir = os.path.join(nd.root, "peers")
            held[nd.name] = len([d for d in os.listdir(pdir) if not d.startswith(".")]) if os.path.isdir(pdir) else 0
        out["copies_held_per_node"] = dict(held)
        out["copies_held_min_max"] = [min(held.values()), max(held.values())]
        lost = c.nodes[5 % n]
        c.wipe(lost)
        t0 = time.monotonic()
        load = Job(c, os.path.join(work, "load"), "load", {**env, "ZS_REPAIR_BARRIER": "1"}, launcher=launcher)
        codes = load.wait(1800)
        if codes != [0] * n:
            raise SystemExit(f"scale: the load run failed: {codes}\n{load.tail(1500)}")
        ev = load.events()
        loaded = of(ev, "loaded")
        out["load_run_s"] = time.monotonic() - t0
        out["loaded_all"] = len(loaded) == n and all(e["equal"] and e["step"] == 2 for e in loaded)
        out["replaced"] = lost.name
        out["replaced_source"] = next((e["source"] for e in loaded if e["node"] == lost.name), None)
        first = min(e["t"] for e in of(ev, "started"))
        out["load_s"] = max(e["t"] for e in loaded) - first
        out["repaired_s"] = max(e["t"] for e in of(ev, "repaired")) - first
        out["repaired_all"] = all(e["ok"] for e in of(ev, "repaired")) and len(of(ev, "repaired")) == n
        pdir = os.path.join(lost.root, "peers")
        out["replacement_holds_again"] = sorted(d for d in os.listdir(pdir) if not d.startswith(".")) \
            if os.path.isdir(pdir) else []
        out["load_avg_end"] = os.getloadavg()
        return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m tests.cluster.scale", description=__doc__.split("\n\n")[0])
    ap.add_argument("--nodes", type=int, default=16)
    ap.add_argument("--mib", type=float, default=1.0, help="MiB of state per rank")
    ap.add_argument("--launcher", choices=("bare", "torchrun"), default="bare")
    ap.add_argument("--json", default=None)
    a = ap.parse_args(argv)
    work = tempfile.mkdtemp(prefix="zs-scale-")
    try:
        res = run(a.nodes, work, a.launcher, a.mib)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    print(json.dumps(res, indent=1))
    if a.json:
        with open(a.json, "w") as f:
            json.dump(res, f, indent=1)
    return 0 if res["loaded_all"] and res["durable_step2"] and res["protected_step2"] else 1


if __name__ == "__main__":
    sys.exit(main())
