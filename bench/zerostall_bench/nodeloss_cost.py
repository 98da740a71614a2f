"""``zerostall bench --scenario replication-cost``: what paced peer replication costs the
training, per ``peers.cpu_priority`` setting, and of coded copies (RS(2,1), at the default
priority), alternated in one run.

The save phase of ``--scenario node-loss`` (:mod:`.nodeloss`: 4 simulated nodes x 1 rank on
gloo, ``--size-gib`` of state in all, ``replicas=2``, 200 MB/s per node; rank 0 trains a
384x384 matmul loop in its main thread before, during and after the save until the step is
protected, and 1.5 s after), and the same with ``peers.code="rs"`` RS(2,1) at the default
``cpu_priority`` (each node's files coded into 2 data + 1 parity fragments on its 3 peers,
1.5x the state sent instead of 1x), run ``--repeat`` times per setting, the settings' order reversed
every other round (the machine's other load drifts). ``--methods`` picks settings (e.g.
``idle,rs2,1``: replicas=2 at the default priority and RS(2,1)). Per run: rank 0's step time
idle (the 1.5 s before the save and the 1.5 s after the step is protected) and in the window
where only the paced copies run (durable -> protected), means and medians, and
``step_time_copying_over_idle``: the step time while the copies run divided by the idle step
time (medians of the steps; above 1: the copies slow the trainer; the target is <= 1.05), the
same of the means, the CPU seconds every node's process spent in that window, and the load
average when the run started. Medians per setting.

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
from .nodes import split_methods
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
            idle_med = statistics.median(docs[0]["before"] + docs[0]["after"]) * 1e3
            rep_med = statistics.median(docs[0]["replicating"] or [0.0]) * 1e3
            runs.append({"round": r, "cpu_priority": mode, "load_avg_1m": round(load, 2),
                         "step_ms_idle": round(idle, 3), "step_ms_replicating_only": round(rep, 3),
                         "step_ms_idle_median": round(idle_med, 3), "step_ms_copying_median": round(rep_med, 3),
                         "step_time_copying_over_idle": round(rep_med / max(idle_med, 1e-9), 3),
                         "step_time_copying_over_idle_means": round(rep / max(idle, 1e-9), 3),
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
                     ("step_ms_idle", "step_ms_replicating_only", "step_ms_idle_median", "step_ms_copying_median",
                      "step_time_copying_over_idle", "step_time_copying_over_idle_means", "protected_s")}
        out[mode]["cpu_replicating_s_nodes_1_3"] = statistics.median(sum(x["cpu_replicating_s"][1:]) for x in mine)
    return out


def modes_of(methods: str | None) -> tuple[str, ...]:
    """``--methods`` (:func:`.nodes.split_methods`), checked; default :data:`MODES`."""
    out = split_methods(methods) if methods else list(MODES)
    for m in out:
        if m not in ("normal", "nice", "idle") and not (m.startswith("rs") and m.count(",") == 1
                                                         and m[2:].replace(",", "").isdigit()):
            raise SystemExit(f"replication-cost: --methods {m!r}: use normal, nice, idle or rs<k>,<m> (e.g. rs2,1)")
    return tuple(out)


def main(a: argparse.Namespace) -> int:
    modes = modes_of(a.methods)
    with workdir(a, "zerostall-replication-cost-") as work:
        res = run(a.size_gib, work, a.repeat, modes)
    print(f"replication cost: {NODES} nodes x {res['state_mib_per_node']} MiB, replicas=2 per cpu_priority and "
          f"RS(2,1) at the default, peer cap "
          f"{CAP_BYTES / 1e6:.0f} MB/s per node; rank 0's step time while only the paced copies run vs idle")
    for x in res["runs"]:
        print(f"  round {x['round']} {x['cpu_priority']:6s} load {x['load_avg_1m']:5.2f}: "
              f"idle {x['step_ms_idle']:.2f} ms, "
              f"while copying {x['step_ms_replicating_only']:.2f} ms (means) over {x['steps_replicating_only']} steps; "
              f"step time while copying / idle = {x['step_time_copying_over_idle']:.3f} (medians; means "
              f"{x['step_time_copying_over_idle_means']:.3f}); protected after {x['protected_s']:.2f} s; CPU s per "
              f"node {x['cpu_replicating_s']}")
    for mode in modes:
        m = res[mode]
        print(f"  median {mode:6s}: step time while copying / idle = {m['step_time_copying_over_idle']:.3f} "
              f"(above 1: slower; target <= 1.05), nodes 1-3 CPU "
              f"{m['cpu_replicating_s_nodes_1_3']:.2f} s, protected after {m['protected_s']:.2f} s")
    write_doc(res, a.json)
    return 0
