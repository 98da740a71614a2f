"""Crash anywhere: SIGKILL a process that saves in a loop, then prove what survived.

The child saves ``state_of(step)`` for step = newest committed + 1, +2, ... as fast as the
async pipeline allows (``keep_last=3``, so retention runs too). The parent kills it at a
random moment (during snapshot, persist, commit or retention), then checks that the newest
committed checkpoint loads bit-exact and equals ``state_of`` its step, and that every
committed step verifies. Used by ``tests/fault`` (>= 30 kills) and
``bench/scripts/soak_crash.py`` (200 kills). With ``incremental=True`` the state also holds a
frozen part, saved with ``Checkpointer(incremental=True, full_every=3)``: most steps then
reference an earlier step's file, and retention must keep it.
"""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field

import torch

from tests.helpers import states_equal

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # for -m tests.fault.crashsoak


def state_of(step: int, incremental: bool = False) -> dict[str, object]:
    g = torch.Generator().manual_seed(step)
    out = {"w": torch.full((1 << 20,), float(step)), "r": torch.randn(100_000 + step % 977, generator=g),
           "i": torch.arange(4096, dtype=torch.int64) * step, "meta": {"step": step, "name": f"s{step}"}}
    if incremental:  # frozen: identical bytes at every step
        out["frozen"] = torch.randn(1 << 20, generator=torch.Generator().manual_seed(7))
    return out


def child(directory: str, incremental: bool = False, ready: str = "READY") -> None:
    from zerostall.checkpointer import Checkpointer
    opts = {"incremental": True, "full_every": 3} if incremental else {}
    with Checkpointer(directory, keep_last=3, **opts) as ck:
        step = (ck.latest_step() or 0) + 1
        frozen = state_of(0, incremental).get("frozen")
        print(ready, flush=True)
        while True:
            state = state_of(step, incremental)
            if frozen is not None:
                state["frozen"] = frozen  # the same tensor, unchanged: referenced, not rewritten
            ck.save(step, state)
            step += 1


@dataclass
class Tally:
    kills: int = 0
    ok: int = 0
    empty: int = 0  # killed before the first commit
    partial_seen: int = 0
    referencing: int = 0  # checks where the newest step referenced an earlier step's file
    leftovers_seen: int = 0  # a kill left .deleting-*/.old/latest.tmp (the next owner removes them)
    max_steps: int = 0  # most committed steps found after a kill (keep_last + 1: see store/retention.py)
    failures: list[str] = field(default_factory=list)


def check(directory: str, tally: Tally, incremental: bool = False) -> None:
    from zerostall.errors import ZerostallError
    from zerostall.io import get_engine
    from zerostall.config import IOConfig
    from zerostall.restore import LoadRequest, load, verify_step
    from zerostall.store import open_root
    tier = open_root(directory)
    steps = tier.steps()
    tally.partial_seen += bool(tier.partial_steps())
    tally.leftovers_seen += any(not n.endswith(".partial") for n in tier.leftovers())
    tally.max_steps = max(tally.max_steps, len(steps))
    if not steps:
        tally.empty += 1
        return
    try:
        got = load(directory, None, LoadRequest(fallback=False))
        if not states_equal(got, state_of(steps[-1], incremental)):
            tally.failures.append(f"kill {tally.kills}: step {steps[-1]} loads but differs from its state")
            return
        tally.referencing += bool(tier.read_manifest(steps[-1]).ref_files)
        eng = get_engine("threads", IOConfig())
        for s in steps:
            verify_step(tier, s, eng)
        eng.close()
        tally.ok += 1
    except ZerostallError as exc:
        tally.failures.append(f"kill {tally.kills}: {exc}")


def _die_with_parent() -> None:
    """A forked child gets SIGKILL if its zygote dies (a test killed mid-soak leaves no saver behind)."""
    import ctypes
    try:
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


def zygote(directory: str, incremental: bool) -> None:
    """Runs in one helper process that has imported torch and zerostall but run no torch op
    (so no thread pool exists yet): on each ``go`` line from the parent it forks a child that
    runs :func:`child` and prints ``READY <pid>``; on ``reap`` it waits for that child (which the
    parent has SIGKILLed; until reaped its pid cannot be reused) and prints ``DEAD <status>``.
    Each kill then costs a fork, not a fresh interpreter importing torch."""
    from zerostall import checkpointer, restore  # noqa: F401  (imported once, before any fork)
    pid = 0
    for line in sys.stdin:
        if line.strip() == "go":
            sys.stdout.flush()
            pid = os.fork()
            if pid == 0:
                try:
                    _die_with_parent()
                    child(directory, incremental, ready=f"READY {os.getpid()}")
                except BaseException as exc:  # noqa: BLE001  (the parent records it as a failure)
                    print(f"FAILED {type(exc).__name__}: {exc}".replace("\n", " "), flush=True)
                finally:
                    os._exit(1)
        elif line.strip() == "reap":
            _, status = os.waitpid(pid, 0)
            print(f"DEAD {status}", flush=True)


def run(directory: str, kills: int, seed: int = 0, max_delay_s: float = 0.4, progress: bool = False,
        incremental: bool = False) -> Tally:
    rnd = random.Random(seed)
    tally = Tally()
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([REPO, os.environ.get("PYTHONPATH", "")]))
    z = subprocess.Popen([sys.executable, "-m", "tests.fault.crashsoak", directory, "zygote"]
                         + (["incremental"] if incremental else []), env=env,
                         stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    assert z.stdin is not None and z.stdout is not None
    try:
        for _ in range(kills):
            z.stdin.write("go\n")
            z.stdin.flush()
            line = z.stdout.readline().split()
            if len(line) != 2 or line[0] != "READY":
                tally.failures.append(f"child did not start: {' '.join(line)}")
                break
            pid = int(line[1])
            time.sleep(rnd.uniform(0.0, max_delay_s))
            os.kill(pid, signal.SIGKILL)  # our zygote's child, not yet reaped: the pid is still its
            z.stdin.write("reap\n")
            z.stdin.flush()
            dead = z.stdout.readline().split()
            if dead[:1] != ["DEAD"]:
                tally.failures.append(f"zygote did not reap its child: {dead}")
                break
            status = int(dead[1])
            if not (os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGKILL):
                tally.failures.append(f"kill {tally.kills}: the child ended by itself (status {status})")
            tally.kills += 1
            check(directory, tally, incremental)
            if progress:
                print(f"\rkills {tally.kills}/{kills}: ok {tally.ok}, failures {len(tally.failures)}", end="",
                      flush=True)
    finally:
        z.stdin.close()
        try:
            z.wait(timeout=60)
        except subprocess.TimeoutExpired:
            z.kill()
            z.wait()
    if progress:
        print()
    return tally


if __name__ == "__main__":
    args = sys.argv[2:]
    if args[:1] == ["zygote"]:
        zygote(sys.argv[1], incremental=args[1:] == ["incremental"])
    else:
        child(sys.argv[1], incremental=args == ["incremental"])
