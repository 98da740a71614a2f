"""One simulated node of ``zerostall bench --scenario node-loss`` (started by
:mod:`.nodeloss` with torchrun-style env and ``ZEROSTALL_NODE``); writes a JSON result.

argv: mode base out mib replicas bandwidth remote [cpu_priority]. ``replicas``: N, or ``rs<k>,<m>``
for coded copies (``peers.code="rs"``). ``save``: rank 0 runs a timed training
loop (a matmul per step) in its main thread for 1.5 s, saves step 1 (``mib`` MiB per rank),
and keeps training until the step is protected by ``replicas`` nodes (and on the remote
tier, if any); the other ranks save and wait. ``load``: every rank restores; its load time
is reported; ``load_remote``: the same, n1's files downloaded from ``remote`` first.
"""

from __future__ import annotations

import os
import sys
import time

import torch
import torch.distributed as dist

from .nodes import Trainer, leave, state as make_state


def main() -> None:
    mode, base, out, mib, replicas, bw, remote = sys.argv[1:8]
    cpu = sys.argv[8] if len(sys.argv) > 8 else "idle"
    import logging
    logging.basicConfig(level=logging.INFO, format=f"%(relativeCreated)d [{os.environ['ZEROSTALL_NODE']}] %(message)s")
    import zerostall
    from zerostall import PeersConfig
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    node = os.environ["ZEROSTALL_NODE"]
    torch.set_num_threads(1)
    code = {}
    if replicas.startswith("rs"):
        k, m = (int(x) for x in replicas[2:].split(","))
        code, replicas = dict(code="rs", data_fragments=k, parity_fragments=m), "1"
    ck = zerostall.Checkpointer(  # load_remote: the same restart, without peer replicas
        os.path.join(base, node), dist_name="node-loss", replicas=1 if mode == "load_remote" else int(replicas),
        peers=PeersConfig(bandwidth_bytes=int(bw) or None, timeout_s=60, cpu_priority=cpu,
                          **(code if mode != "load_remote" else {})),
        remote=(remote or None) if mode == "save" else None,
        commit_timeout_s=300, close_timeout_s=120)
    res: dict[str, object] = {"rank": rank, "node": node}
    if mode == "save":
        state = make_state(rank, int(mib))
        ck.prepare(state, wait=True)
        dist.barrier()  # every node's state made and staged: nothing else runs in rank 0's idle window
        trainer = Trainer()
        train, steps = trainer.train, trainer.steps
        t_save = trainer.lead_in(rank == 0)
        h = ck.save(1, state)
        durable_at: list[float] = []
        cpu_at: list[float] = []  # process CPU seconds (every thread) when durable

        def done() -> bool:
            if not h.done():
                return False
            if not durable_at:
                durable_at.append(time.monotonic())
                cpu_at.append(time.process_time())
            return (ck._peers is None or ck._peers.status(1) is not None and ck._peers.status(1).done.is_set()) \
                and (not remote or h.replicated())
        if rank == 0:
            train(None, done)
        h.result()
        if not cpu_at:
            cpu_at.append(time.process_time())
        if ck._peers is not None:
            h.wait(tier="peers")
        res["cpu_replicating_s"] = time.process_time() - cpu_at[0]
        if remote:
            h.wait(tier="remote")
        t_protected = time.monotonic()
        res["t_done_s"] = t_protected - t_save
        if rank == 0:
            train(t_protected + 1.5)  # idle again: the step time before and after brackets the save
        dist.barrier()  # the others close only after rank 0's idle window after the save
        res["protected"] = h.protected()
        res["before"] = [d for t, d in steps if t < t_save]
        res["during"] = [d for t, d in steps if t >= t_save and (rank != 0 or t < t_protected)]
        # after the step is durable, until it is protected: only the paced copies run then
        res["replicating"] = [d for t, d in steps if durable_at and durable_at[0] <= t < t_protected]
        res["after"] = [d for t, d in steps if rank == 0 and t >= t_protected]
        res["bytes_sent"] = ck._peers.replicator.bytes_sent if ck._peers is not None else 0  # type: ignore[union-attr]
        res["state_bytes"] = sum(t.numel() * 4 for t in state.values())
    else:  # load (n1's files from its peers) / load_remote (from the remote tier ``remote``)
        # Timed alike for every tier, from the barrier every node leaves at once: ``files_s``
        # until n1's files are in its root (committed), ``load_s`` until its collective
        # ``Checkpointer.load`` returned (every byte read back and verified, then applied).
        # The other nodes load their own files in the same collective load, both ways.
        state = {k: torch.empty_like(v) for k, v in make_state(rank, int(mib)).items()}
        report = zerostall.LoadReport()
        dist.barrier()
        t0 = time.monotonic()
        if mode == "load_remote" and node == "n1":
            from .nodeloss import fetch_from
            fetch_from(remote, ck.tier, rank)
            res["files_s"] = time.monotonic() - t0
        ck.load(state, report=report)
        res["load_s"] = time.monotonic() - t0
        if mode == "load" and ck._peers is not None and ck._peers.last_fetch_end:
            res["files_s"] = ck._peers.last_fetch_end - t0
            res["fetch_s"] = ck._peers.last_fetch_s
        res["source"] = report.source if mode == "load" else "remote"
        res["equal"] = all(torch.equal(state[k], v) for k, v in make_state(rank, int(mib)).items())
    leave(ck, res, out, world)


if __name__ == "__main__":
    main()
