"""What the node-loss benches share (:mod:`.nodeloss`, :mod:`.nodeloss_coded` and their workers
:mod:`.nodeloss_worker`, :mod:`.nodeloss_coded_worker`): starting one process per simulated node
and collecting their JSON results (the bench's thread), and inside a node's process its state,
the timed training loop and the way out (the worker's main thread)."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from typing import Any, Callable

import torch


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


Spawn = Callable[[int, list[str], dict[str, str]], subprocess.Popen]


def run_nodes(bench: str, mode: str, work: str, nodes: int, argv: Callable[[int, str], list[str]],
              env: Callable[[int], dict[str, str]], spawn: Spawn | None = None) -> list[dict[str, Any]]:
    """One process per node (rank r: ``argv(r, its result file)``, torchrun-style ``env(r)``
    added to this process's environment, ``spawn`` to start it elsewhere, e.g. in a network
    namespace); their JSON results in rank order. A node that fails ends the bench with its stderr."""
    procs = []
    for r in range(nodes):
        out = os.path.join(work, f"{mode}-n{r}.json")
        if os.path.exists(out):
            os.unlink(out)
        cmd = [sys.executable, "-m", *argv(r, out)]
        if spawn is None:
            p = subprocess.Popen(cmd, env=dict(os.environ, **env(r)), stderr=subprocess.PIPE, text=True)
        else:
            p = spawn(r, cmd, env(r))
        procs.append((p, out))
    docs = []
    for p, out in procs:
        _, err = p.communicate(timeout=1800)
        if p.returncode != 0 or not os.path.exists(out):
            raise SystemExit(f"{bench}: a node failed in {mode} (rc {p.returncode}):\n{err[-3000:]}")
        docs.append(json.load(open(out)))
        if os.environ.get("ZS_BENCH_LOG"):
            print(err, file=sys.stderr)
    return docs


def node_env(rank: int, nodes: int, port: int, mib: int) -> dict[str, str]:
    """torchrun's variables for rank ``rank`` of ``nodes`` one-rank nodes, and a staging budget for ``mib``."""
    return dict(MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(nodes), LOCAL_RANK="0", LOCAL_WORLD_SIZE="1",
                ZEROSTALL_BUDGET_BYTES=str(max(64, mib + 16) << 20))


# -- inside a node's process (the worker's main thread) ----------------------------------------

def state(rank: int, mib: int) -> dict[str, torch.Tensor]:
    """Rank ``rank``'s ``mib`` MiB of float32 state in 8 tensors (the same on every call)."""
    g = torch.Generator().manual_seed(rank)
    n = mib << 20 >> 2
    return {f"t{i}": torch.randn(n // 8, generator=g) for i in range(8)}


class Trainer:
    """The in-process trainer whose step time the benches report: a 384x384 matmul per step on
    the worker's main thread, each step's ``(monotonic end, seconds)`` in :attr:`steps`."""

    def __init__(self) -> None:
        self.x = torch.randn(384, 384)
        self.steps: list[tuple[float, float]] = []

    def lead_in(self, trains: bool, seconds: float = 1.5) -> float:
        """``seconds`` of idle steps (on the rank that ``trains``; the others wait as long, so
        that every rank saves at once: the commit is collective); the monotonic time after."""
        t_start = time.monotonic() + seconds
        if trains:
            self.train(t_start)
        time.sleep(max(0.0, t_start - time.monotonic()))
        return time.monotonic()

    def train(self, until: float | None, cond: Callable[[], bool] | None = None) -> None:
        """Steps until ``until`` (monotonic) or ``cond()``."""
        while (until is None or time.monotonic() < until) and not (cond is not None and cond()):
            t0 = time.perf_counter()
            torch.mm(self.x, self.x)
            self.steps.append((time.monotonic(), time.perf_counter() - t0))


def leave(ck: Any, res: dict[str, Any], out: str, world: int) -> None:
    """Close ``ck``, write ``res`` to ``out`` and exit; rank 0 (the c10d store's host) only once
    every other node's result is written (``out`` names the node: ``...-n<r>.json``)."""
    ck.close()
    json.dump(res, open(out, "w"))
    if res["rank"] == 0:
        others = [out.replace(f"-{res['node']}.json", f"-n{r}.json") for r in range(1, world)]
        deadline = time.monotonic() + 300
        while not all(os.path.exists(o) for o in others) and time.monotonic() < deadline:
            time.sleep(0.05)
    os._exit(0)


def split_methods(methods: str) -> list[str]:
    """``--methods`` of the peer benches: comma-separated, ``rs<k>,<m>`` keeping its own comma
    (``idle,rs2,1`` -> ``["idle", "rs2,1"]``)."""
    out: list[str] = []
    for tok in (t.strip() for t in methods.split(",") if t.strip()):
        if tok.isdigit() and out and out[-1].startswith("rs") and "," not in out[-1]:
            out[-1] += "," + tok
        else:
            out.append(tok)
    return out
