"""One node of ``zerostall bench --scenario node-loss-coded`` (started by :mod:`.nodeloss_coded`
with torchrun-style env and ``ZEROSTALL_NODE``, inside its network namespace when the cluster
harness is used); writes a JSON result.

argv: mode root out mib protect. ``protect``: ``r<N>`` (``replicas=N``) or ``rs<k>,<m>``
(``peers.code="rs"``). ``save``: rank 0 runs a timed training loop (a 384x384 matmul per step)
for 1.5 s, every rank saves step 1 (``mib`` MiB), rank 0 trains on until the step is protected,
then 1.5 s more; ``load``: every rank restores (a wiped node from its peers) and reports how long
its files took to come in and its load.
"""

from __future__ import annotations

import json
import os
import sys
import time
from typing import Any

import torch
import torch.distributed as dist


def _state(rank: int, mib: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(rank)
    n = mib << 20 >> 2
    return {f"t{i}": torch.randn(n // 8, generator=g) for i in range(8)}


def main() -> None:
    mode, root, out, mib_s, protect = sys.argv[1:6]
    mib = int(mib_s)
    import logging
    logging.basicConfig(level=logging.INFO, format=f"%(relativeCreated)d [{os.environ['ZEROSTALL_NODE']}] %(message)s")
    import zerostall
    from zerostall import PeersConfig
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.set_num_threads(1)
    if protect.startswith("rs"):
        k, m = (int(x) for x in protect[2:].split(","))
        kw: dict[str, Any] = {"peers": PeersConfig(code="rs", data_fragments=k, parity_fragments=m, timeout_s=60)}
    else:
        kw = {"replicas": int(protect[1:]), "peers": PeersConfig(timeout_s=60)}
    ck = zerostall.Checkpointer(root, dist_name="node-loss-coded", commit_timeout_s=300, close_timeout_s=120, **kw)
    res: dict[str, Any] = {"rank": rank, "node": os.environ["ZEROSTALL_NODE"]}
    if mode == "save":
        state = _state(rank, mib)
        ck.prepare(state, wait=True)
        dist.barrier()
        x = torch.randn(384, 384)
        steps: list[tuple[float, float]] = []

        def train(until: float | None, cond: Any = None) -> None:
            while (until is None or time.monotonic() < until) and not (cond is not None and cond()):
                t0 = time.perf_counter()
                torch.mm(x, x)
                steps.append((time.monotonic(), time.perf_counter() - t0))
        t_start = time.monotonic() + 1.5
        if rank == 0:
            train(t_start)
        time.sleep(max(0.0, t_start - time.monotonic()))
        t_save = time.monotonic()
        h = ck.save(1, state)
        durable_at: list[float] = []

        def done() -> bool:
            if h.done() and not durable_at:
                durable_at.append(time.monotonic())
            st = ck._peers.status(1)
            return h.done() and st is not None and st.done.is_set()
        if rank == 0:
            train(None, done)
        h.result()
        h.wait(tier="peers")
        t_protected = time.monotonic()
        if rank == 0:
            train(t_protected + 1.5)
        dist.barrier()
        rep = ck._peers.replicator
        res.update(protected=h.protected(), t_protected_s=t_protected - t_save,
                   bytes_sent=rep.bytes_sent, encode_cpu_s=getattr(rep, "encode_cpu_s", 0.0),
                   state_bytes=sum(t.numel() * 4 for t in state.values()),
                   idle=[d for t, d in steps if t < t_save or t >= t_protected],
                   replicating=[d for t, d in steps if durable_at and durable_at[0] <= t < t_protected])
    else:
        state = {k: torch.empty_like(v) for k, v in _state(rank, mib).items()}
        report = zerostall.LoadReport()
        dist.barrier()
        t0 = time.monotonic()
        ck.load(state, report=report)
        res["load_s"] = time.monotonic() - t0
        if ck._peers.last_fetch_end:
            res["files_s"], res["fetch_s"] = ck._peers.last_fetch_end - t0, ck._peers.last_fetch_s
        res["source"] = report.source
        res["equal"] = all(torch.equal(state[k], v) for k, v in _state(rank, mib).items())
    ck.close()
    json.dump(res, open(out, "w"))
    if rank == 0:  # the store's host leaves last
        others = [out.replace(f"-{res['node']}.json", f"-n{r}.json") for r in range(1, world)]
        deadline = time.monotonic() + 300
        while not all(os.path.exists(o) for o in others) and time.monotonic() < deadline:
            time.sleep(0.05)
    os._exit(0)


if __name__ == "__main__":
    main()
