"""``zerostall bench --scenario replication-cost``: what paced peer replication costs the
training, per ``peers.cpu_priority`` setting, and of coded copies (RS(2,1), at the default
priority), alternated in one run.

The save phase of ``--scenario node-loss`` (:mod:`.nodeloss`: 4 simulated nodes x 1 rank on
gloo, ``--size-gib`` of state in all, ``replicas=2``, 200 MB/s per node; rank 0 trains a
384x384 matmul loop in its main thread before, during and after the save until the step is
protected, and 1.5 s after), and the same with ``peers.code="rs"`` RS(2,1) at the default
``cpu_priority`` (each node's files coded into 2 data + 1 parity fragments on its 3 peers,
1.5x the state sent instead of 1x), run ``--repeat`` times per setting, the settings' order reversed
every other round (the machine's other load drifts). Per run: rank 0's mean step time idle
(the 1.5 s before the save and the 1.5 s after the step is protected) and in the window where
only the paced copies run (durable -> protected), their ratio, the CPU seconds every node's
process spent in that window, and the load average when the run started. Medians per setting.

Runs on the CLI's thread; the nodes are subprocesses of :mod:`.nodeloss_worker`.
"""

from __future__ import annotations

import argparse
import datetime
import os
import shutil
import statistics
from typing import Any

from .nodeloss import CAP_BYTES, NODES, _ms, _run, workdir
from .report import write_doc

MODES = ("normal", "nice", "idle", "rs2,1")
"""``peers.cpu_priority`` settings of ``replicas=2``; ``rs<k>,<m>``: that code at the default priority."""


def run(size_gib: float, work: str, rounds: int, modes: tuple[str, ...] = MODES) -> dict[str, Any]:
    mib = max(1, int(size_gib * 1024 / NODES))
    base = os.path.join(work, "job")
    runs: list[dict[str, Any]] = []
    for r in range(rounds):
        for mode in modes if r % 2 == 0 else modes[::-1]:
            shutil.rmtree(base, ignore_errors=True)
            load = os.getloadavg()[0]
            coded = mode.startswith("rs")
            docs = _run("save", base, work, mib, mode if coded else 2, CAP_BYTES, "",
                        cpu="idle" if coded else mode)
            idle = _ms(docs[0]["before"] + docs[0]["after"])
            rep = _ms(docs[0]["replicating"])
            runs.append({"round": r, "cpu_priority": mode, "load_avg_1m": round(load, 2),
                         "step_ms_idle": round(idle, 3), "step_ms_replicating_only": round(rep, 3),
                         "replicating_over_idle": round(rep / max(idle, 1e-9), 3),
                         "steps_replicating_only": len(docs[0]["replicating"]),
                         "protected_s": round(max(d["t_done_s"] for d in docs), 3),
                         "protected": all(d["protected"] for d in docs),
                         "cpu_replicating_s": [round(d["cpu_replicating_s"], 3) for d in docs]})
    shutil.rmtree(base, ignore_errors=True)
    out: dict[str, Any] = {"scenario": "replication-cost", "nodes": NODES, "state_mib_per_node": mib,
                           "peer_bandwidth_bytes": CAP_BYTES, "rounds": rounds, "runs": runs,
                           "date_utc": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")}
    for mode in modes:
        mine = [x for x in runs if x["cpu_priority"] == mode]
        out[mode] = {k: statistics.median(x[k] for x in mine) for k in
                     ("step_ms_idle", "step_ms_replicating_only", "replicating_over_idle", "protected_s")}
        out[mode]["cpu_replicating_s_nodes_1_3"] = statistics.median(sum(x["cpu_replicating_s"][1:]) for x in mine)
    return out


def main(a: argparse.Namespace) -> int:
    with workdir(a, "zerostall-replication-cost-") as work:
        res = run(a.size_gib, work, a.repeat)
    print(f"replication cost: {NODES} nodes x {res['state_mib_per_node']} MiB, replicas=2 per cpu_priority and "
          f"RS(2,1) at the default, peer cap "
          f"{CAP_BYTES / 1e6:.0f} MB/s per node; rank 0's step time while only the paced copies run vs idle")
    for x in res["runs"]:
        print(f"  round {x['round']} {x['cpu_priority']:6s} load {x['load_avg_1m']:5.2f}: "
              f"idle {x['step_ms_idle']:.2f} ms, "
              f"replicating {x['step_ms_replicating_only']:.2f} ms over {x['steps_replicating_only']} steps "
              f"= {x['replicating_over_idle']:.2f}x; protected after {x['protected_s']:.2f} s; CPU s per node "
              f"{x['cpu_replicating_s']}")
    for mode in MODES:
        m = res[mode]
        print(f"  median {mode:6s}: {m['replicating_over_idle']:.3f}x idle, nodes 1-3 CPU "
              f"{m['cpu_replicating_s_nodes_1_3']:.2f} s, protected after {m['protected_s']:.2f} s")
    write_doc(res, a.json)
    return 0
