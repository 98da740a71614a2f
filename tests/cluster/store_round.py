"""Many ranks' commit round through one real c10d TCPStore across namespaces: ``--nodes`` nodes
of the namespace cluster, ``--ranks`` ranks on each (threads of one process per node,
:mod:`.store_worker`, forked from one process that imported torch once), the store hosted in
n0's namespace on its 10.x address, every rank's requests crossing the bridge (n0's own ranks
go to its address too).

Phases, timed from the ranks' events (one clock for every namespace):

- **connect**: every rank's ``TCPStore`` client and zerostall's own connection (``clone``);
- **join**: the library's start-up round (each node's root a copy of its own: one group per
  node, led by its lowest rank);
- **round** of a step: the first rank's ``begin`` to the last rank's handle outcome (each rank:
  ``StoreCommitter.begin``, its shard written and fdatasync'ed, ``commit_round``: report,
  rank 0's merge and decision, every copy's leader recording it, the renames);
- **decision**: the first rank entering the round to the last rank knowing the decision.

Steps: 1 commits. With the fault (default): in step 2 node ``n<N/2>``'s ranks stop after
entering the round (its deadline set, nothing reported), its link goes down, they go on: the
round fails on every rank (the others at the deadline, the coordinator's abort naming the
cut-off ranks; the cut-off node's own ranks ``OutcomeUnknown`` by the deadline plus two
graces, having deleted nothing), no node commits the step, and only then the link heals; step 3
commits on every rank. Checked on disk: every node's copy holds ``step-1`` and ``step-3``
with one manifest (same checkpoint id, every rank's file), none holds ``step-2``.

The 512-rank run (not in CI; a few minutes on a small machine; root)::

    PYTHONPATH=$PWD/src python -m tests.cluster.store_round --nodes 16 --ranks 32 --json out.json

CI runs 4 nodes x 16 ranks (``tests/cluster/test_cluster.py``).
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time
from typing import Any

from zerostall.format.manifest import Manifest

from .harness import Cluster, unavailable

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(os.path.dirname(HERE))


def grace_s(timeout_s: float) -> float:
    """:func:`zerostall.distributed.commit.grace_s` (kept here: the driver does not import torch)."""
    return min(max(1.0, timeout_s / 4), 10.0)


class _Run:
    def __init__(self, c: Cluster, ctl: str, procs: list[subprocess.Popen]):
        self.c, self.ctl, self.procs = c, ctl, procs

    def events(self) -> list[dict[str, Any]]:
        out = []
        for path in glob.glob(os.path.join(self.ctl, "events-*.jsonl")):
            with open(path) as f:
                out.extend(json.loads(ln) for ln in f if ln.endswith("\n"))
        return out

    def tail(self, n: int = 2000) -> str:
        out = []
        for path in sorted(glob.glob(os.path.join(self.ctl, "nodes.log"))):
            with open(path) as f:
                out.append(f"--- {os.path.basename(path)}\n{f.read()[-4 * n:]}")
        return "\n".join(out)

    def wait(self, pred: Any, timeout: float, what: str) -> list[dict[str, Any]]:
        """Poll the events until ``pred(events)`` holds; a node process that exited, a rank's
        error or the timeout raises, with the nodes' logs."""
        end = time.monotonic() + timeout
        while True:
            ev = self.events()
            errors = [e for e in ev if e["ev"] == "error"]
            if errors:
                raise RuntimeError(f"{what}: rank {errors[0]['rank']} failed: {errors[0]['tb']}")
            if pred(ev):
                return ev
            dead = [(k, p.returncode) for k, p in enumerate(self.procs) if p.poll() is not None]
            if dead or time.monotonic() > end:
                raise RuntimeError(f"{what}: {'node process(es) exited ' + str(dead) if dead else 'timed out'}\n"
                                   f"{self.tail()}")
            time.sleep(0.05)

    def gate(self, name: str) -> float:
        open(os.path.join(self.ctl, name), "w").close()
        return time.monotonic()


def _rounds(ev: list[dict[str, Any]], step: int) -> list[dict[str, Any]]:
    return [e for e in ev if e["ev"] == "round" and e["step"] == step]


def _copies(c: Cluster, step: int) -> dict[str, Any]:
    """What every node's copy of the root holds of ``step``: the committed manifest's
    checkpoint id, file and tree counts (None: no ``step-N``), and whether a partial is left."""
    out = {}
    for nd in c.nodes:
        root = os.path.join(nd.root, "root")
        man = os.path.join(root, f"step-{step}", "manifest.json")
        got: dict[str, Any] = {"partial": os.path.isdir(os.path.join(root, f"step-{step}.partial"))}
        if os.path.exists(man):
            with open(man, "rb") as f:
                m = Manifest.from_bytes(f.read(), man)  # the library's parser: envelope crc, every field
            got.update(checkpoint_id=m.checkpoint_id, files=len(m.files), rank_trees=len(m.rank_trees or ()),
                       step=m.step, world=m.world_size)
        out[nd.name] = got
    return out


def _step_stats(ev: list[dict[str, Any]], step: int) -> dict[str, Any]:
    rs = _rounds(ev, step)
    entered = [e["t_entered"] for e in rs if "t_entered" in e]
    decided = [e["t_decided"] for e in rs if "t_decided" in e]
    out: dict[str, Any] = {
        "round_s": max(e["t_end"] for e in rs) - min(e["t_begin"] for e in rs),
        "entry_spread_s": (max(entered) - min(entered)) if entered else None,
        "decision_s": (max(decided) - min(entered)) if decided and entered else None,
        "outcomes": {o: sum(1 for e in rs if e["outcome"] == o) for o in sorted({e["outcome"] for e in rs})},
    }
    errors = sorted({e["error"] for e in rs if "error" in e})
    if errors:
        out["errors"] = errors[:4]
    return out


def run(nodes: int, ranks: int, work: str, *, timeout: float = 60.0, fault: bool = True,
        fault_timeout: float = 5.0, rate_mbit: float | None = None, port: int = 29500) -> dict[str, Any]:
    """Build the cluster, run steps 1 (and with ``fault`` 2 cut, 3 healed), check them;
    returns the figures and ``problems`` (empty: every check held). Cleans up at the end."""
    why = unavailable()
    if why:
        raise RuntimeError(f"store_round: {why}")
    world = nodes * ranks
    steps, timeouts = ([1, 2, 3], [timeout, fault_timeout, timeout]) if fault else ([1], [timeout])
    victim = nodes // 2 if fault and nodes > 1 else None
    ctl = os.path.join(work, "ctl")
    os.makedirs(ctl, exist_ok=True)
    out: dict[str, Any] = {"nodes": nodes, "ranks_per_node": ranks, "world": world, "commit_timeout_s": timeout,
                           "machine": f"{platform.node()}, {os.cpu_count()} CPUs, kernel {platform.release()}",
                           "date_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                           "load_avg_start": os.getloadavg(), "rate_mbit": rate_mbit}
    problems: list[str] = []
    with Cluster(nodes, rate_mbit=rate_mbit, base=os.path.join(work, "cluster")) as c:
        out["store"] = f"{c.nodes[0].addr}:{port} (n0's namespace)"
        env = {"PYTHONPATH": os.pathsep.join([REPO, os.path.join(REPO, "src"), os.environ.get("PYTHONPATH", "")]),
               "PYTHONUNBUFFERED": "1", "ZS_DRIVER_PID": str(os.getpid())}
        spec = [{"name": nd.name, "ns": nd.ns, "root": nd.root} for nd in c.nodes]
        argv = [sys.executable, "-m", "tests.cluster.store_worker", "--ctl", ctl, "--spec", json.dumps(spec),
                "--master", c.nodes[0].addr, "--ranks", str(ranks), "--port", str(port),
                "--steps", ",".join(map(str, steps)), "--timeouts", ",".join(map(str, timeouts)),
                "--victim", str(-1 if victim is None else victim), "--cut-step", "2"]
        t_spawn = time.monotonic()
        with open(os.path.join(ctl, "nodes.log"), "w") as log:  # the zygote forks the node processes
            procs = [c.nodes[0].spawn(argv, env=env, cwd=REPO, stdout=log, stderr=subprocess.STDOUT)]
        r = _Run(c, ctl, procs)
        ev = r.wait(lambda e: sum(x["ev"] == "up" for x in e) == nodes, 900, "start-up")
        out["start_s"] = max(e["t"] for e in ev if e["ev"] == "up") - t_spawn
        t_go = r.gate("go-connect")
        ev = r.wait(lambda e: sum(x["ev"] == "joined" for x in e) == world, 600, "connect + join")
        out["connect_s"] = max(e["t"] for e in ev if e["ev"] == "connected") - t_go
        out["join_s"] = max(e["t"] for e in ev if e["ev"] == "joined") - max(
            e["t"] for e in ev if e["ev"] == "connected")
        groups = {e["groups"] for e in ev if e["ev"] == "joined"}
        if groups != {nodes}:
            problems.append(f"join: the ranks found {sorted(groups)} copies of the root, not {nodes}")
        for step, t_out in zip(steps, timeouts):
            r.gate(f"go-{step}")
            if step == 2 and victim is not None:
                vn = c.nodes[victim]
                r.wait(lambda e: sum(x["ev"] == "entered" and x["step"] == 2 for x in e) == ranks, 300,
                       f"{vn.name}'s ranks entering the round of step 2")
                c.partition([vn])
                t_cut = r.gate("cut-2")
                cap = t_out + 2 * grace_s(t_out) + 120  # past the documented bound by far: then it is a finding
                try:
                    ev = r.wait(lambda e: len(_rounds(e, 2)) == world, cap, "every rank's outcome of step 2")
                    ended_before_heal = True
                except RuntimeError as exc:
                    problems.append(f"step 2: not every rank's handle ended while the partition held: {exc}")
                    ended_before_heal = False
                t_heal = time.monotonic()
                c.heal()
                if not ended_before_heal:
                    ev = r.wait(lambda e: len(_rounds(e, 2)) == world, 300, "step 2 after the heal")
                out["fault"] = _fault_stats(ev, vn.name, victim, ranks, t_out, t_cut, t_heal, problems)
            else:
                ev = r.wait(lambda e: len(_rounds(e, step)) == world, max(600, 3 * t_out), f"step {step}")
            st = out[f"step{step}"] = _step_stats(ev, step)
            copies = _copies(c, step)
            if step != 2 or victim is None:
                ids = {v.get("checkpoint_id") for v in copies.values()}
                if st["outcomes"] != {"durable": world}:
                    problems.append(f"step {step}: outcomes {st['outcomes']}, not {world} durable")
                bad = {n: v for n, v in copies.items() if v.get("files") != world or v.get("rank_trees") != world
                       or v["partial"] or v.get("step") != step or v.get("world") != world}
                if bad or len(ids) != 1:
                    problems.append(f"step {step}: the copies on disk disagree or are incomplete: {bad or copies}")
                st["on_disk"] = f"{len(copies)} copies, checkpoint id {sorted(map(str, ids))}, {world} files each"
            else:
                held = [n for n, v in copies.items() if "checkpoint_id" in v]
                if held:
                    problems.append(f"step 2: committed on {held} although the round failed")
                st["on_disk"] = f"step-2 committed on {len(held)} of {len(copies)} nodes"
        r.gate("end")
        for p in procs:
            try:
                p.wait(60)
            except subprocess.TimeoutExpired:
                problems.append("a node process did not exit after `end`")
        out["load_avg_end"] = os.getloadavg()
    out["problems"] = problems
    return out


def _fault_stats(ev: list[dict[str, Any]], vname: str, victim: int, ranks: int, t_out: float, t_cut: float,
                 t_heal: float, problems: list[str]) -> dict[str, Any]:
    rs = _rounds(ev, 2)
    vr = set(range(victim * ranks, (victim + 1) * ranks))
    maj = [e for e in rs if e["rank"] not in vr]
    cut = [e for e in rs if e["rank"] in vr]
    t0 = min(e["t_entered"] for e in rs if "t_entered" in e)
    errors = {e.get("error") for e in maj}
    missing = {tuple(e.get("missing", ())) for e in maj}
    if {e["outcome"] for e in maj} != {"failed"} or len(errors) != 1:
        problems.append(f"step 2: the connected ranks did not all fail with one decision: "
                        f"{sorted({(e['outcome'], e.get('error')) for e in maj}, key=str)[:4]}")
    if any(not vr <= set(m) for m in missing):
        problems.append(f"step 2: the abort does not name every cut-off rank: {sorted(missing)[:3]}")
    if {e["outcome"] for e in cut} != {"unknown"}:
        problems.append(f"step 2: {vname}'s ranks: {sorted({(e['outcome'], e.get('error')) for e in cut}, key=str)[:3]}")
    late = [e["rank"] for e in rs if e["t_end"] > t_heal]
    if late:
        problems.append(f"step 2: ranks {late[:8]} ended only after the heal")
    return {"cut_node": vname, "commit_timeout_s": t_out, "grace_s": grace_s(t_out),
            "bound_connected_s": t_out, "bound_cut_off_s": t_out + 2 * grace_s(t_out),
            "connected_end_after_first_entry_s": max(e["t_end"] for e in maj) - t0,
            "cut_off_end_after_first_entry_s": max(e["t_end"] for e in cut) - t0,
            "cut_after_first_entry_s": t_cut - t0, "heal_after_first_entry_s": t_heal - t0,
            "decision": next(iter(errors)) if len(errors) == 1 else sorted(map(str, errors))[:3],
            "missing_ranks_named": sorted({r for m in missing for r in m}) == sorted(vr)}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m tests.cluster.store_round", description=__doc__.split("\n\n")[0])
    ap.add_argument("--nodes", type=int, default=16)
    ap.add_argument("--ranks", type=int, default=32, help="ranks per node (threads of the node's process)")
    ap.add_argument("--timeout", type=float, default=60.0, help="commit_timeout_s of the steps that commit")
    ap.add_argument("--fault-timeout", type=float, default=10.0, help="commit_timeout_s of the cut round")
    ap.add_argument("--no-fault", action="store_true", help="step 1 only")
    ap.add_argument("--rate-mbit", type=float, default=None, help="shape every node's link (tc tbf)")
    ap.add_argument("--json", default=None)
    ap.add_argument("--keep", default=None, help="copy the events and the nodes' logs into this directory")
    a = ap.parse_args(argv)
    work = tempfile.mkdtemp(prefix="zs-store-round-")
    try:
        res = run(a.nodes, a.ranks, work, timeout=a.timeout, fault=not a.no_fault, fault_timeout=a.fault_timeout,
                  rate_mbit=a.rate_mbit)
    finally:
        if a.keep:
            shutil.copytree(os.path.join(work, "ctl"), a.keep, dirs_exist_ok=True)
        shutil.rmtree(work, ignore_errors=True)
    print(json.dumps(res, indent=1))
    if a.json:
        with open(a.json, "w") as f:
            json.dump(res, f, indent=1)
    return 0 if not res["problems"] else 1


if __name__ == "__main__":
    sys.exit(main())
