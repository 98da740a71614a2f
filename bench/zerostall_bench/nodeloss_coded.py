"""``zerostall bench --scenario node-loss-coded``: ``replicas=3`` against a Reed-Solomon code
(``peers.code="rs"``, RS(4,2) by default) in one run, 7 nodes x 1 rank, ``--size-gib`` of
state in all.

Where it runs: on the namespace cluster harness (``tests/cluster/harness.py``: each node a
network namespace with its own address and a ``tc`` shaped link, :data:`LINK_MBIT` each way) when
it is available (root, ``ip netns``, ``tc``); otherwise as simulated nodes on 127.0.0.1 (no
link limits), and the result says which (``where``).

Per protection, in the order given, ``--repeat`` rounds with the order reversed every other:

1. *save*: every node saves step 1 (:mod:`.nodeloss_coded_worker`); rank 0 trains before, while
   the step is coded and sent, and after it is protected. Measured: bytes every node's leader
   moved to peers (acknowledged) against the state, the sender thread's CPU seconds in the
   parity arithmetic per GB of state, rank 0's step time while only the copies run (durable ->
   protected) against idle (before the save, after protected; means and medians), the time
   to protected;
2. *recovery*: node n1 wiped (its root and everything it held for others), the job restarted;
   n1's files come from its peers while the others load their own. On the cluster, n1's link is
   ``RESTORE_LINK_X`` times a holder's for this phase: a replacement whose link is faster than
   one holder's share is what k parallel fetches are for; with replicas=3 its file comes from
   its 2 holders (ranges), with RS(k,m) from k holders. Measured: n1's files in (committed)
   and loaded, from the barrier all nodes leave at once, its fetch alone, and what its bytes
   take over one holder's link (``LINK_MBIT``): what k parallel fetches are to beat. With a
   code, from the rebuild's timeline (:class:`zerostall.peers.coded_decode.Timeline`): each
   holder's stream (first to last byte, MB/s, and as a fraction of its link), and the
   fetch's fraction of the k-link limit: (n1's bytes / k) / link rate, the time k holders'
   links need at full rate, divided by the fetch's time (1.0: every holder's egress full
   from the first byte to the commit).

Runs on the CLI's thread; the nodes are subprocesses.
"""

from __future__ import annotations

import argparse
import datetime
import os
import shutil
import statistics
import subprocess
import sys
from typing import Any

from .nodeloss import _ms, workdir
from .nodes import free_port, node_env, run_nodes, split_methods
from .report import write_doc

NODES = 7
LINK_MBIT = int(os.environ.get("ZS_BENCH_LINK_MBIT", "400"))
"""Every node's link on the cluster, each way (env ``ZS_BENCH_LINK_MBIT``)."""
RESTORE_LINK_X = 8
"""n1's link while it recovers, in holders' links: twice the k = 4 holders' egress together, so the holders'
egress stays the limit (at 4x, n1's ingress would be a second bottleneck of the same rate)."""
PROTECTIONS = ("r3", "rs4,2")


def _harness() -> Any:
    """The cluster harness module, or None (with the reason printed) when it cannot run here."""
    repo = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    if not os.path.exists(os.path.join(repo, "tests", "cluster", "harness.py")):
        print("node-loss-coded: no tests/cluster/harness.py beside this bench: simulated nodes on 127.0.0.1")
        return None
    sys.path.insert(0, repo)
    from tests.cluster import harness
    why = harness.unavailable()
    if why:
        print(f"node-loss-coded: the cluster harness cannot run here ({why}): simulated nodes on 127.0.0.1")
        return None
    return harness


def _phase(cluster: Any, mode: str, roots: list[str], work: str, mib: int, protect: str) -> list[dict[str, Any]]:
    port = free_port() if cluster is None else 29500 + (os.getpid() % 1000)

    def env(r: int) -> dict[str, str]:
        e = node_env(r, NODES, port, mib)
        return e if cluster is not None else dict(e, MASTER_ADDR="127.0.0.1", ZEROSTALL_NODE=f"n{r}")

    def spawn(r: int, cmd: list[str], e: dict[str, str]) -> subprocess.Popen:
        return cluster.nodes[r].spawn(cmd, env=e, stderr=subprocess.PIPE, text=True)
    return run_nodes(f"node-loss-coded ({protect})", mode, work, NODES,
                     lambda r, out: ["zerostall_bench.nodeloss_coded_worker", mode, roots[r], out, str(mib), protect],
                     env, None if cluster is None else spawn)


def _one(cluster: Any, work: str, mib: int, protect: str) -> dict[str, Any]:
    roots = [os.path.join(work if cluster is None else cluster.nodes[r].root, f"job-{protect}", f"n{r}")
             for r in range(NODES)]
    for root in roots:
        shutil.rmtree(root, ignore_errors=True)
    load = os.getloadavg()[0]
    saved = _phase(cluster, "save", roots, work, mib, protect)
    state = sum(d["state_bytes"] for d in saved)
    shutil.rmtree(roots[1])
    if cluster is not None:
        cluster.set_rate(cluster.nodes[1], LINK_MBIT * RESTORE_LINK_X)
    try:
        loaded = _phase(cluster, "load", roots, work, mib, protect)
    finally:
        if cluster is not None:
            cluster.set_rate(cluster.nodes[1], LINK_MBIT)
    for root in roots:
        shutil.rmtree(root, ignore_errors=True)
    idle, rep = _ms(saved[0]["idle"]), _ms(saved[0]["replicating"])
    idle_med, rep_med = _median_ms(saved[0]["idle"]), _median_ms(saved[0]["replicating"])
    n1 = loaded[1]
    link_bps = LINK_MBIT * 1e6 / 8
    one_link = saved[1]["state_bytes"] / link_bps if cluster is not None else 0.0
    streams = [s for s in n1.get("timeline", {}).get("streams", []) if s["end"] == "done"]
    k = int(protect[2:].split(",")[0]) if protect.startswith("rs") else min(int(protect[1:]) - 1, 2)
    k_link = one_link / k
    return {"protect": protect, "load_avg_1m": round(load, 2), "state_bytes": state,
            "bytes_moved_per_save": sum(d["bytes_sent"] for d in saved),
            "moved_over_state": round(sum(d["bytes_sent"] for d in saved) / state, 4),
            "encode_cpu_s_per_gb": round(sum(d["encode_cpu_s"] for d in saved) / (state / 1e9), 3),
            "protected": all(d["protected"] for d in saved),
            "protected_after_s": round(max(d["t_protected_s"] for d in saved), 3),
            "step_ms_idle": round(idle, 3), "step_ms_replicating": round(rep, 3),
            "step_time_copying_over_idle_means": round(rep / max(idle, 1e-9), 3),
            "steps_replicating": len(saved[0]["replicating"]),
            "step_ms_idle_median": round(idle_med, 3), "step_ms_replicating_median": round(rep_med, 3),
            "step_time_copying_over_idle": round(rep_med / max(idle_med, 1e-9), 3),
            "n1_one_link_s": round(one_link, 3), "n1_k_link_limit_s": round(k_link, 3),
            "n1_fetch_of_k_link": round(k_link / n1["fetch_s"], 3) if n1.get("fetch_s") and k_link else 0.0,
            "n1_streams": [{"fragment": s["fragment"], "node": s["node"], "MBps": round(s["Bps"] / 1e6, 2),
                            "of_link": round(s["Bps"] / link_bps, 3) if cluster is not None else 0.0,
                            "connected_s": s["connected_s"], "first_byte_s": s["first_byte_s"],
                            "last_byte_s": s["last_byte_s"]} for s in streams],
            "n1_stream_of_link_median": round(statistics.median(s["Bps"] / link_bps for s in streams), 3)
            if streams and cluster is not None else 0.0,
            "n1_phases": n1.get("timeline", {}).get("phases", {}),
            "n1_source": n1["source"], "n1_files_in_s": round(n1.get("files_s", 0.0), 3),
            "n1_fetch_s": round(n1.get("fetch_s", 0.0), 3), "n1_loaded_s": round(n1["load_s"], 3),
            "bit_exact": all(d["equal"] for d in loaded)}


def _median_ms(xs: list[float]) -> float:
    return statistics.median(xs) * 1e3 if xs else 0.0


def run(size_gib: float, work: str, rounds: int, protections: tuple[str, ...] = PROTECTIONS) -> dict[str, Any]:
    mib = max(1, int(size_gib * 1024 / NODES))
    harness = _harness()
    cluster = harness.Cluster(NODES, rate_mbit=LINK_MBIT) if harness is not None else None
    runs = []
    try:
        for r in range(rounds):
            for protect in protections if r % 2 == 0 else protections[::-1]:
                runs.append({"round": r, **_one(cluster, work, mib, protect)})
    finally:
        if cluster is not None:
            cluster.close()
    out: dict[str, Any] = {
        "scenario": "node-loss-coded", "nodes": NODES, "state_mib_per_node": mib, "rounds": rounds, "runs": runs,
        "where": (f"namespace cluster, links {LINK_MBIT} mbit each way (n1 {LINK_MBIT * RESTORE_LINK_X} mbit while it "
                  "recovers)") if cluster is not None else "simulated nodes on 127.0.0.1, no link limits",
        "date_utc": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")}
    for protect in protections:
        mine = [x for x in runs if x["protect"] == protect]
        out[protect] = {k: statistics.median(x[k] for x in mine) for k in
                        ("moved_over_state", "encode_cpu_s_per_gb", "protected_after_s", "step_ms_idle",
                         "step_ms_replicating", "step_time_copying_over_idle_means", "step_time_copying_over_idle",
                         "n1_files_in_s", "n1_fetch_s", "n1_one_link_s", "n1_k_link_limit_s", "n1_fetch_of_k_link",
                         "n1_stream_of_link_median", "n1_loaded_s")}
    return out


def main(a: argparse.Namespace) -> int:
    protections = tuple(split_methods(a.methods)) if a.methods else PROTECTIONS
    for p in protections:
        if not (p[:1] == "r" and p[1:].isdigit() or p.startswith("rs") and p.count(",") == 1):
            raise SystemExit(f"node-loss-coded: --methods {p!r}: use r<N> (replicas=N) or rs<k>,<m> (e.g. rs4,2)")
    with workdir(a, "zerostall-node-loss-coded-") as work:
        res = run(a.size_gib, work, a.repeat, protections)
    print(f"node-loss-coded: {NODES} nodes x {res['state_mib_per_node']} MiB; {res['where']}")
    for x in res["runs"]:
        print(f"  round {x['round']} {x['protect']:6s} load {x['load_avg_1m']:5.2f}: moved "
              f"{x['moved_over_state']:.3f} x state, encode {x['encode_cpu_s_per_gb']:.2f} CPU-s/GB, "
              f"protected after {x['protected_after_s']:.2f} s, "
              f"step time {x['step_ms_replicating']:.2f} ms vs {x['step_ms_idle']:.2f} idle "
              f"(step time while copying / idle {x['step_time_copying_over_idle']:.2f}, medians; means "
              f"{x['step_time_copying_over_idle_means']:.2f}; "
              f"{x['steps_replicating']} steps); n1 ({x['n1_source']}) files in "
              f"{x['n1_files_in_s']:.2f} s (fetch {x['n1_fetch_s']:.2f}; one holder's link: "
              f"{x['n1_one_link_s']:.2f}; k-link limit {x['n1_k_link_limit_s']:.2f}: "
              f"{x['n1_fetch_of_k_link']:.2f} of it), loaded {x['n1_loaded_s']:.2f} s; "
              f"bit-exact {x['bit_exact']}")
        for st in x["n1_streams"]:
            print(f"      fragment {st['fragment']} from {st['node']}: {st['MBps']:.1f} MB/s "
                  f"({st['of_link']:.2f} of its link), first byte {st['first_byte_s']:.2f} s, last "
                  f"{st['last_byte_s']:.2f} s")
        if x["n1_phases"]:
            print("      phases (first, last event, s): " + ", ".join(
                f"{k} {v[0]:.2f}-{v[1]:.2f}" for k, v in x["n1_phases"].items()))
    for protect in protections:
        m = res[protect]
        print(f"  median {protect:6s}: moved {m['moved_over_state']:.3f} x state, {m['encode_cpu_s_per_gb']:.2f} "
              f"CPU-s/GB, step time while copying / idle {m['step_time_copying_over_idle']:.2f}, protected {m['protected_after_s']:.2f} s, "
              f"n1 files in {m['n1_files_in_s']:.2f} s (fetch {m['n1_fetch_s']:.2f} s: {m['n1_fetch_of_k_link']:.2f} "
              f"of the k-link limit; streams {m['n1_stream_of_link_median']:.2f} of a link), "
              f"loaded {m['n1_loaded_s']:.2f} s")
    write_doc(res, a.json)
    return 0
