"""A job of :mod:`.node_worker` ranks on a :class:`~tests.cluster.harness.Cluster`, one rank
per node, and its events log (the test's own events go into the same file, so the file's
order is the order of everything that happened).

Launchers: ``"bare"`` (``RANK``/``WORLD_SIZE``/``MASTER_ADDR`` = n0's address: rank 0 hosts
the c10d store in n0's namespace) or ``"torchrun"`` (one ``torchrun --rdzv-backend=c10d``
agent per node; n0's agent hosts the store). Runs on the test's thread.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from typing import Any, Callable

from .harness import Cluster, Node

HERE = os.path.dirname(os.path.abspath(__file__))
WORKER = os.path.join(HERE, "node_worker.py")
REPO = os.path.dirname(os.path.dirname(HERE))


class Job:
    def __init__(self, cluster: Cluster, ctl: str, scenario: str, env: dict[str, str] | None = None,
                 launcher: str = "bare", nodes: list[Node] | None = None, port: int = 29500):
        self.cluster, self.ctl, self.scenario = cluster, ctl, scenario
        os.makedirs(ctl, exist_ok=True)
        self.nodes = list(cluster.nodes if nodes is None else nodes)
        self.logs: list[str] = []
        self.procs: list[subprocess.Popen] = []
        base = {"PYTHONPATH": os.pathsep.join([HERE, os.path.join(REPO, "src"), os.environ.get("PYTHONPATH", "")]),
                "ZEROSTALL_BUDGET_BYTES": str(64 << 20), "PYTHONUNBUFFERED": "1", **(env or {})}
        self.event("launch", scenario=scenario, launcher=launcher)
        rid = f"{cluster.tag}-{scenario}-{time.monotonic_ns()}"
        for k, nd in enumerate(self.nodes):
            log = os.path.join(ctl, f"{scenario}-{nd.name}.log")
            self.logs.append(log)
            env_k = {**base, "ZS_ROOT": nd.root, "ZS_ADDR": nd.addr}
            if launcher == "torchrun":
                argv = cluster.torchrun_argv(cluster.nodes.index(nd), [WORKER, scenario, ctl], port=port,
                                             nnodes=len(self.nodes), rdzv_id=rid)
            else:
                argv = [sys.executable, WORKER, scenario, ctl]
                env_k.update(MASTER_PORT=str(port), RANK=str(k), WORLD_SIZE=str(len(self.nodes)), LOCAL_RANK="0",
                             LOCAL_WORLD_SIZE="1")
            with open(log, "a") as f:
                self.procs.append(nd.spawn(argv, env=env_k, stdout=f, stderr=subprocess.STDOUT))

    # -- events -------------------------------------------------------------------------------
    def event(self, what: str, **kw: Any) -> None:
        line = json.dumps({"ev": what, "node": "test", "t": time.monotonic(), **kw}) + "\n"
        fd = os.open(os.path.join(self.ctl, "events.jsonl"), os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        try:
            os.write(fd, line.encode())
        finally:
            os.close(fd)

    def events(self) -> list[dict[str, Any]]:
        try:
            with open(os.path.join(self.ctl, "events.jsonl")) as f:
                return [json.loads(ln) for ln in f if ln.strip()]
        except FileNotFoundError:
            return []

    def wait_for(self, pred: Callable[[list[dict[str, Any]]], Any], timeout: float, what: str) -> Any:
        """Poll the events until ``pred(events)`` is true (returns it); a rank that died or the
        timeout fails the test with the ranks' logs."""
        end = time.monotonic() + timeout
        while True:
            got = pred(self.events())
            if got:
                return got
            dead = [(nd.name, p.returncode) for nd, p in zip(self.nodes, self.procs) if p.poll() not in (None, 0)]
            if dead or time.monotonic() > end:
                raise AssertionError(f"{what}: {'rank(s) died ' + str(dead) if dead else 'timed out'}\n{self.tail()}")
            time.sleep(0.05)

    def gate(self, name: str) -> None:
        self.event("gate", name=name)
        open(os.path.join(self.ctl, f"gate-{name}"), "w").close()

    def wait(self, timeout: float) -> list[int | None]:
        """Wait for every rank to exit; returns their exit codes (None: still running at the end,
        then killed)."""
        end = time.monotonic() + timeout
        codes: list[int | None] = []
        for p in self.procs:
            try:
                codes.append(p.wait(max(end - time.monotonic(), 0.1)))
            except subprocess.TimeoutExpired:
                codes.append(None)
        for p in self.procs:
            if p.poll() is None:
                self.cluster.kill(p)
        return codes

    def tail(self, n: int = 4000) -> str:
        out = []
        for log in self.logs:
            try:
                out.append(f"--- {os.path.basename(log)}\n" + open(log).read()[-n:])
            except OSError:
                pass
        return "\n".join(out)


def of(events: list[dict[str, Any]], name: str, **match: Any) -> list[dict[str, Any]]:
    """The events called ``name`` whose fields equal ``match``."""
    return [e for e in events if e["ev"] == name and all(e.get(k) == v for k, v in match.items())]


def index(events: list[dict[str, Any]], name: str, **match: Any) -> int:
    """The position of the first such event in the log (-1: none)."""
    for i, e in enumerate(events):
        if e["ev"] == name and all(e.get(k) == v for k, v in match.items()):
            return i
    return -1

