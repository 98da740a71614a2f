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

import os
import sys
import time
from typing import Any

import torch
import torch.distributed as dist

from .nodes import Trainer, leave, state as make_state


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
        state = make_state(rank, mib)
        ck.prepare(state, wait=True)
        dist.barrier()
        trainer = Trainer()
        train, steps = trainer.train, trainer.steps
        t_save = trainer.lead_in(rank == 0)
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
        state = {k: torch.empty_like(v) for k, v in make_state(rank, mib).items()}
        report = zerostall.LoadReport()
        dist.barrier()
        t0 = time.monotonic()
        ck.load(state, report=report)
        res["load_s"] = time.monotonic() - t0
        if ck._peers.last_fetch_end:
            res["files_s"], res["fetch_s"] = ck._peers.last_fetch_end - t0, ck._peers.last_fetch_s
        if ck._peers.last_timeline is not None:
            res["timeline"] = ck._peers.last_timeline.summary()
        res["source"] = report.source
        res["equal"] = all(torch.equal(state[k], v) for k, v in make_state(rank, mib).items())
    leave(ck, res, out, world)


if __name__ == "__main__":
    main()
