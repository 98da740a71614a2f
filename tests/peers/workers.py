"""What every rank of the tests/peers multi-process jobs does, for the ``*_worker.py`` scripts.

A test starts one process per simulated node (``test_peers._spawn``, ``test_peers._fb_spawn``)
with ``argv = scenario base out`` and the env of a torchrun rank plus ``ZEROSTALL_NODE``; the
worker script runs in that process's main thread: :func:`start` joins the gloo group, a
Checkpointer is built (:func:`checkpointer`, :func:`env_checkpointer`), steps are saved and
protected (:func:`save_steps`) or loaded (:func:`load_into`), and the rank's result document
is written (:func:`report`) before it leaves (:func:`leave`). The test reads the documents.
"""

import json
import logging
import os
import sys
import time

import torch
import torch.distributed as dist

import zerostall
from helpers import equal
from zerostall import PeersConfig


def start():
    """``(scenario, base, out, rank, node)``: the argv, logging tagged with the node, the gloo
    group joined (its c10d store is rank 0's or the test's, as the env says)."""
    scenario, base, out = sys.argv[1], sys.argv[2], sys.argv[3]
    node = os.environ["ZEROSTALL_NODE"]
    logging.basicConfig(level=logging.INFO, format=f"%(relativeCreated)d [{node}] %(message)s")
    dist.init_process_group("gloo")
    return scenario, base, out, dist.get_rank(), node


def state_for(rank, step, rows=256, cols=1024, bias=True):
    """The state rank ``rank`` saves at ``step`` (seeded by both): ``w`` (rows x cols), a bf16
    ``b`` unless ``bias`` is false, and ``meta``."""
    g = torch.Generator().manual_seed(rank * 1000 + step)
    state = {"w": torch.randn(rows, cols, generator=g)}
    if bias:
        state["b"] = torch.randn(257, generator=g).to(torch.bfloat16)
    state["meta"] = {"rank": rank, "step": step}
    return state


_FROZEN = {}


def frozen_state(rank, step):
    """The same ``frozen`` tensor object every time (an incremental save references it) and a
    ``w`` that changes with the step."""
    g = torch.Generator().manual_seed(rank * 1000 + step)
    if rank not in _FROZEN:
        _FROZEN[rank] = torch.randn(256, 1024, generator=torch.Generator().manual_seed(rank))
    return {"frozen": _FROZEN[rank], "w": torch.randn(64, 1024, generator=g), "meta": {"rank": rank, "step": step}}


def checkpointer(root, dist_name, peers, **kw):
    """A Checkpointer on ``root`` with the tests' commit and close deadlines."""
    return zerostall.Checkpointer(root, dist_name=dist_name, peers=peers, commit_timeout_s=30, close_timeout_s=4, **kw)


def env_checkpointer(base, **kw):
    """The peer-replica job's Checkpointer on ``base/<node>``, configured by the env:
    ZS_REPLICAS, ZS_REMOTE (a file:// URL or empty), ZS_QUOTA (peers.quota_bytes), ZS_PT and
    ZS_RT (peers.timeout_s and replica_timeout_s)."""
    quota = int(os.environ["ZS_QUOTA"]) if os.environ.get("ZS_QUOTA") else None
    peers = PeersConfig(timeout_s=float(os.environ.get("ZS_PT", 5)),
                        replica_timeout_s=float(os.environ.get("ZS_RT", 30)), quota_bytes=quota)
    return checkpointer(os.path.join(base, os.environ["ZEROSTALL_NODE"]), "peers-test", peers,
                        replicas=int(os.environ["ZS_REPLICAS"]), remote=os.environ.get("ZS_REMOTE") or None, **kw)


def protect(ck, step, state, **kw):
    """Save ``state`` as ``step`` and wait (up to 60 s) for its peer copies; the handle."""
    h = ck.save(step, state, **kw)
    h.result()
    h.wait(tier="peers", timeout=60)
    return h


def save_steps(ck, rank, steps, res, state=state_for, key="protected", nodes=False):
    """:func:`protect` each of ``steps`` (``state(rank, step)``), recording whether it was
    protected in ``res[key][step]`` and, with ``nodes``, its holders in ``res["replica_nodes"]``."""
    for s in steps:
        h = protect(ck, s, state(rank, s))
        res.setdefault(key, {})[s] = h.protected()
        if nodes:
            res.setdefault("replica_nodes", {})[s] = list(h.result().replica_nodes)


def load_into(ck, state, expect, res):
    """Load the agreed step into ``state``; record its step, source, why, and whether the values
    equal ``expect(step)``, or the error and its type."""
    report = zerostall.LoadReport()
    try:
        ck.load(state, report=report)
        res["step"], res["source"], res["why"] = report.step, report.source, report.why
        res["equal"] = equal(state, expect(report.step))
    except zerostall.errors.ZerostallError as exc:
        res["error"], res["error_type"] = str(exc), type(exc).__name__


def report(res, out):
    """Write this rank's result document for the test."""
    with open(out, "w") as f:
        json.dump(res, f)


def leave(out, absent=(), wait_s=60):
    """Exit now (``os._exit``: a stopped or dead peer must not hold our exit). Rank 0 hosts the
    c10d store, so it first waits up to ``wait_s`` for every other rank's document (``out``
    with its rank), but for the ranks in ``absent`` (killed or stopped ones)."""
    if dist.get_rank() == 0:
        others = [out.replace("-r0.json", f"-r{r}.json") for r in range(1, dist.get_world_size()) if r not in absent]
        deadline = time.monotonic() + wait_s
        while not all(os.path.exists(o) for o in others) and time.monotonic() < deadline:
            time.sleep(0.05)
    os._exit(0)
