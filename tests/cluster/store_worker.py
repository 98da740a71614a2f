"""The nodes of the store-round run (:mod:`.store_round`): one process per node, inside the
node's namespace, whose ``--ranks`` ranks are threads; node 0's process also hosts the job's
c10d ``TCPStore`` on n0's 10.x address, as rank 0 does under a bare launch. The driver starts
one zygote in n0's namespace (:func:`main`): it imports torch and zerostall once and forks the
node processes, each moving into its own node's namespace (``setns``), so N nodes cost one
import, not N.

Each rank is what the library makes of a rank, minus torch tensors: its own ``TCPStore``
client to n0 over the bridge, wrapped in :class:`~zerostall.distributed.store.Store` (which
opens its own connection, ``clone()``); the real start-up round
(:func:`~zerostall.distributed.session.join`, every node's root a copy of its own, so one
group per node, led by its lowest rank); then, per step, the persist thread's commit
strategy :class:`~zerostall.saving.commit.StoreCommitter` (``begin`` -> its shard file
written and fdatasync'ed in ``step-N.partial`` -> ``commit``, i.e.
:func:`~zerostall.distributed.commit.commit_round`; ``fail`` on an error). Only the shard's
content and the fragment describing it are synthetic (the round never reads a shard).

Control (the driver's thread, files in ``--ctl``, shared by every namespace): the node's
main thread polls for ``go-connect``, ``go-<step>``, ``cut-<step>`` and ``end`` and wakes
the ranks; events are JSON lines in ``events-<node>.jsonl`` (times: ``time.monotonic()``,
one clock for every namespace of the machine). With ``--victim K`` node K's ranks stop at
the round's ``entered`` point of step ``--cut-step`` (the round's deadline is set, they have
not reported) until ``cut-<step>`` exists: the driver takes the node's link down in between.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import logging
import os
import signal
import sys
import threading
import time
import traceback
from datetime import timedelta
from types import SimpleNamespace
from typing import Any

if __name__ == "__main__" and os.environ.get("ZS_DRIVER_PID"):  # before the imports that take seconds
    ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG: die with the driver
    if os.getppid() != int(os.environ["ZS_DRIVER_PID"]):
        os._exit(1)

from torch.distributed import TCPStore  # noqa: E402

from zerostall.distributed import commit  # noqa: E402
from zerostall.distributed.commit import OutcomeUnknown  # noqa: E402
from zerostall.distributed.session import join, namespace  # noqa: E402
from zerostall.distributed.store import Store  # noqa: E402
from zerostall.errors import DistributedError, SaveFailed  # noqa: E402
from zerostall.saving.commit import StoreCommitter  # noqa: E402
from zerostall.store.local import LocalTier  # noqa: E402

SHARD = b"\0" * 4096 + bytes(range(16)) + b"\0" * 4080  # a header page and a data page (O_DIRECT size)


class _Committer(StoreCommitter):
    """The library's strategy with a synthetic fragment (the seam: no tensors, no plan)."""

    def fragment(self, job: Any) -> dict[str, Any]:
        return job.fragment


class Node:
    def __init__(self, a: argparse.Namespace, k: int, name: str, root: str, victim: bool):
        self.a, self.k, self.name, self.root, self.victim = a, k, name, root, victim
        self.addr = a.master
        self.world = a.nodes * a.ranks
        self._mu = threading.Lock()
        self._log = os.path.join(a.ctl, f"events-{self.name}.jsonl")
        self.gates: dict[str, threading.Event] = {}
        self.marks: dict[tuple[int, int], dict[str, float]] = {}

    def ev(self, what: str, **kw: Any) -> None:
        line = json.dumps({"ev": what, "node": self.name, "t": time.monotonic(), **kw}) + "\n"
        with self._mu, open(self._log, "a") as f:
            f.write(line)

    def gate(self, name: str) -> threading.Event:
        with self._mu:
            return self.gates.setdefault(name, threading.Event())

    def watch(self) -> None:
        """Main thread: open the gates whose files appear, until ``end``."""
        while True:
            with self._mu:
                names = [n for n, e in self.gates.items() if not e.is_set()] + ["end"]
            for n in names:
                if os.path.exists(os.path.join(self.a.ctl, n)):
                    self.gate(n).set()
            if self.gate("end").is_set():
                return
            time.sleep(0.01)

    def hook(self, point: str, rank: int, step: int) -> None:
        """The round's fault points: time them; hold the victim's ranks at ``entered``."""
        self.marks.setdefault((rank, step), {})[point] = time.monotonic()
        if self.victim and point == "entered" and step == self.a.cut_step:
            self.ev("entered", rank=rank, step=step)
            self.gate(f"cut-{step}").wait(300)

    def rank(self, r: int) -> None:
        a, world = self.a, self.world
        try:
            self.gate("go-connect").wait()
            t = time.monotonic()
            client = TCPStore(self.addr, a.port, is_master=False, timeout=timedelta(seconds=a.join_timeout))
            store = Store(client)  # zerostall's own connection (clone), bounded calls
            self.ev("connected", rank=r, t0=t)
            tier = LocalTier(os.path.join(self.root, "root"), create=True)
            session = join(store, namespace("", "zs-store-round"), r, world, tier, a.join_timeout)
            self.ev("joined", rank=r, group=session.group, groups=len(session.groups))
            cm = _Committer(tier, store, session, per_rank=True, timeout_s=a.timeouts[0])
            for step, timeout in zip(a.steps, a.timeouts):
                self.gate(f"go-{step}").wait()
                cm.timeout_s = timeout
                self.ev("round", rank=r, step=step, **self.round(cm, r, step))
        except BaseException as exc:  # noqa: BLE001 - the driver reads it
            self.ev("error", rank=r, error=f"{type(exc).__name__}: {exc}", tb=traceback.format_exc()[-3000:])

    def round(self, cm: StoreCommitter, r: int, step: int) -> dict[str, Any]:
        """One step on one rank, as the persist thread runs it; returns what the rank saw."""
        name = f"rank-{r:05d}.shard"
        frag = {"ok": True, "n_tensors": 1, "structure": "",
                "file": {"name": name, "rank": r, "host": self.name, "file_bytes": len(SHARD),
                         "file_id": f"store-round-{step}"},
                "tensors": [[0, {"key": "w", "dtype": "float32", "shape": [4], "file": name, "offset": 4096,
                                 "nbytes": 16, "crc32c": 0}]],
                "tree": {"d": [[{"v": "w"}, {"T": 0}]]}}
        job = SimpleNamespace(step=step, file_name=name, overwrite=False, user_metadata={}, fragment=frag)
        t_begin = time.monotonic()
        out: dict[str, Any] = {"t_begin": t_begin}
        try:
            d = cm.begin(job)
            fd = os.open(os.path.join(d, name), os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
            try:
                os.write(fd, SHARD)
                os.fdatasync(fd)
            finally:
                os.close(fd)
            cm.commit(job)
            out["outcome"] = "durable"
        except BaseException as exc:  # noqa: BLE001
            out["outcome"] = ("unknown" if isinstance(exc, OutcomeUnknown) else "failed"
                              if isinstance(exc, (SaveFailed, DistributedError)) else "error")
            out["error"] = f"{type(exc).__name__}: {exc}"
            out["missing"] = list(getattr(exc, "missing_ranks", ()) or ())
            cm.fail(job, exc)
        out["t_end"] = time.monotonic()
        out.update({f"t_{k}": v for k, v in self.marks.pop((r, step), {}).items()})
        return out


CLONE_NEWNET = 0x40000000
PR_SET_PDEATHSIG = 1


def die_with_parent(parent: int) -> None:
    """SIGKILL this process when its parent (pid ``parent``) ends: the driver killed, no node
    process lingers in a namespace that the next cluster's clean-up deletes."""
    ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    if os.getppid() != parent:  # it ended before the request
        os._exit(1)


def enter(ns: str) -> None:
    """Move this process into the network namespace ``ns`` (as ``ip netns exec`` does, minus
    its mount namespace, which nothing here needs)."""
    libc = ctypes.CDLL(None, use_errno=True)
    fd = os.open(f"/var/run/netns/{ns}", os.O_RDONLY)
    try:
        if libc.setns(fd, CLONE_NEWNET) != 0:
            err = ctypes.get_errno()
            raise OSError(err, f"setns into {ns}: {os.strerror(err)}")
    finally:
        os.close(fd)


def node_main(a: argparse.Namespace, k: int, spec: dict[str, str]) -> int:
    """One node's process: its ranks' threads (and n0's the store) until ``end``."""
    os.environ["ZEROSTALL_NODE"] = spec["name"]
    node = Node(a, k, spec["name"], spec["root"], victim=k == a.victim)
    commit.fault_hook = node.hook
    master = None
    if k == 0:  # the job's store, on n0's address, as rank 0 hosts it under a bare launch
        master = TCPStore(a.master, a.port, world_size=None, is_master=True, wait_for_workers=False,
                          timeout=timedelta(seconds=a.join_timeout))
    for i in range(a.ranks):
        r = k * a.ranks + i
        threading.Thread(target=node.rank, args=(r,), name=f"rank-{r}", daemon=True).start()
    node.ev("up", pid=os.getpid(), store=master is not None)
    node.watch()
    return 0  # the caller's os._exit ends the process; no store teardown to wait for


def main(argv: list[str] | None = None) -> int:
    """The zygote: imports torch and zerostall once, then forks one process per node, each
    moving into its node's namespace; waits for them (a node process that fails is an
    ``error`` event). Started in n0's namespace, so the harness ends everything it leaves."""
    ap = argparse.ArgumentParser()
    ap.add_argument("--ctl", required=True)
    ap.add_argument("--spec", type=json.loads, required=True, help='[{"name", "ns", "root"}, ...] by node')
    ap.add_argument("--master", required=True, help="n0's address: the store's")
    ap.add_argument("--ranks", type=int, required=True)
    ap.add_argument("--port", type=int, required=True)
    ap.add_argument("--steps", type=lambda s: [int(x) for x in s.split(",")], required=True)
    ap.add_argument("--timeouts", type=lambda s: [float(x) for x in s.split(",")], required=True,
                    help="commit_timeout_s of each step's round")
    ap.add_argument("--join-timeout", type=float, default=300.0)
    ap.add_argument("--victim", type=int, default=-1, help="the node whose ranks wait at entered of --cut-step")
    ap.add_argument("--cut-step", type=int, default=0)
    a = ap.parse_args(argv)
    a.nodes = len(a.spec)
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(process)d %(threadName)s %(message)s")
    sys.stdout.flush()
    kids, zygote = {}, os.getpid()
    for k, spec in enumerate(a.spec):
        pid = os.fork()
        if pid == 0:
            rc = 1
            try:
                die_with_parent(zygote)
                enter(spec["ns"])
                rc = node_main(a, k, spec)
            except BaseException:  # noqa: BLE001
                traceback.print_exc()
            finally:
                sys.stdout.flush()
                sys.stderr.flush()
                os._exit(rc)
        kids[pid] = spec["name"]
    rc = 0
    while kids:
        pid, status = os.wait()
        name = kids.pop(pid, None)
        if name is not None and os.waitstatus_to_exitcode(status) != 0:
            rc = 1
            line = json.dumps({"ev": "error", "node": name, "rank": -1, "t": time.monotonic(),
                               "error": f"node {name}'s process (pid {pid}) ended with {status}",
                               "tb": f"node {name}'s process (pid {pid}) ended with status {status}"})
            with open(os.path.join(a.ctl, f"events-{name}.jsonl"), "a") as f:
                f.write(line + "\n")
    return rc


if __name__ == "__main__":
    code = main()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)  # nothing to tear down: the node processes are gone, and torch's teardown takes seconds
