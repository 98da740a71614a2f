"""One rank of the node-loss benchmark on shaped links (:mod:`.nodeloss_links`), inside its
node's namespace. One process per node for the whole benchmark: it joins the process group
once, then runs the driver's commands, one JSON line each on stdin, and answers each with one
JSON line on stdout (its logs go to stderr). Every command builds a fresh ``Checkpointer``
(a restarted job's) and closes it, and forgets the process's restore scratch, so each load
starts as a restarted process does; only the interpreter, torch and the process group stay.

A command: ``{"mode", "root", "replicas", "upload", "remote", "fetch_first"}``, with ``mode``

- ``save``: step 1 saved and protected by ``replicas`` nodes; n1 uploads its files to each
  tier URL of ``upload`` (the S3 server behind its own link, the shared filesystem);
- ``load``: the job restarted with n1's root empty: n1's files come from its peers;
- ``load_remote``: the same without peer replicas: n1 downloads its shard and the manifest
  from ``remote`` first (over its link and the server's), then the collective load.

Timed alike from a barrier every rank leaves at once (``t0``): ``files_s`` until n1's files
are committed in its root, ``load_s`` until the collective load returned, every byte verified.
``restart_s``: the ``Checkpointer``'s start-up before that barrier (the ranks' join, the peer
exchange, the holders' repair copies to the wiped n1), not in those times.
For ``load`` each rank also reports its timeline (seconds after ``t0``): ``offer_s`` (the
ranks agreed what each node can load), ``fetch`` (start, end of this node's peer fetch, or of
its no-op), ``reads_from_s`` (its load goes on to read its files), ``load_s``.
``fetch_first``: every rank waits at a barrier after the fetch step,
so the other nodes' loads start once n1's files are in (see the driver's docstring: on this
one VM the four nodes share a disk and two cores, which a cluster's nodes do not).

Env (fixed for the process): ``ZS_MIB`` (MiB of state per rank) and the launch variables.
"""

import json
import os
import sys
import time

import torch
import torch.distributed as dist

import zerostall
from zerostall import PeersConfig
from zerostall.restore import step as restore_step
from zerostall_bench.nodeloss import fetch_from  # n1's files of step 1 from a remote tier, committed


_states = {}


def state(rank, mib):
    """The rank's state (made once per process: the reference every load is compared with)."""
    if (rank, mib) not in _states:
        g = torch.Generator().manual_seed(rank)
        n = mib << 20 >> 2
        _states[rank, mib] = {f"t{i}": torch.randn(n // 8, generator=g) for i in range(8)}
    return _states[rank, mib]


def upload(root, url):
    from zerostall.store.tier import open_tier
    tier = open_tier(url)
    tier.ensure_root()
    tier.upload(os.path.join(root, "step-1", "rank-00001.shard"), "step-1/rank-00001.shard")
    tier.upload_bytes(open(os.path.join(root, "step-1", "manifest.json"), "rb").read(), "step-1/manifest.json")


def forget_scratch():
    """A restarted process has no restore scratch yet: drop this one's (faulted by an earlier run)."""
    bounce, restore_step._bounce = restore_step._bounce, None
    if bounce is not None:
        bounce.close()


def run(cmd, rank, node, mib):
    mode, root = cmd["mode"], cmd["root"]
    replicas = 1 if mode == "load_remote" else int(cmd.get("replicas", 2))
    forget_scratch()
    t_restart = time.monotonic()
    ck = zerostall.Checkpointer(root, dist_name="node-loss-links", replicas=replicas,
                                peers=PeersConfig(timeout_s=60, replica_timeout_s=900, cpu_priority="normal"),
                                commit_timeout_s=300, close_timeout_s=120)
    res = {"rank": rank, "node": node}
    try:
        if mode == "save":
            st = state(rank, mib)
            t0 = time.monotonic()
            h = ck.save(1, st)
            h.result()
            h.wait(tier="peers")
            res["protected"], res["protected_s"] = h.protected(), time.monotonic() - t0
            if node == "n1":
                for url in cmd.get("upload", "").split():
                    upload(root, url)
            dist.barrier()
            return res
        st = {k: torch.empty_like(v) for k, v in state(rank, mib).items()}
        report = zerostall.LoadReport()
        if ck._peers is not None:  # a holder's repair copies (to the wiped n1) run before the clock, not in it
            ck._peers.replicator.repaired.wait(600)
            plan, fetch = ck._peers.plan_load, ck._peers._fetch

            def timed_plan(*a, **kw):
                got = plan(*a, **kw)
                res["offer_s"] = time.monotonic() - t0
                return got

            def timed_fetch(load, step):
                t = time.monotonic()
                try:
                    return fetch(load, step)
                finally:
                    res["fetch"] = [t - t0, time.monotonic() - t0]
                    if cmd.get("fetch_first"):
                        dist.barrier()  # every rank's load waits for n1's files (caller's thread of each rank)
                    res["reads_from_s"] = time.monotonic() - t0  # this rank's load reads its files from here
            ck._peers.plan_load, ck._peers._fetch = timed_plan, timed_fetch
        res["restart_s"] = time.monotonic() - t_restart  # the Checkpointer's start-up, the holders' repair copies
        dist.barrier()
        t0 = time.monotonic()
        if mode == "load_remote" and node == "n1":
            fetch_from(cmd["remote"], ck.tier, rank)
            res["files_s"] = time.monotonic() - t0
        ck.load(st, report=report)
        res["load_s"] = time.monotonic() - t0
        if mode == "load" and ck._peers.last_fetch_end:
            res["files_s"] = ck._peers.last_fetch_end - t0
            res["fetch_s"] = ck._peers.last_fetch_s
        res["source"] = report.source if mode == "load" else "remote"
        res["equal"] = all(torch.equal(st[k], v) for k, v in state(rank, mib).items())
        res["file_bytes"] = sum(os.path.getsize(os.path.join(root, "step-1", f))
                                for f in os.listdir(os.path.join(root, "step-1")) if f.endswith(".shard"))
        dist.barrier()
        return res
    finally:
        ck.close()


def main():
    out = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)  # stray prints land in the log, not in the answers
    mib = int(os.environ["ZS_MIB"])
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    node = os.environ["ZEROSTALL_NODE"]
    torch.set_num_threads(1)
    for line in sys.stdin:
        res = run(json.loads(line), rank, node, mib)
        out.write(json.dumps(res) + "\n")
        out.flush()
    os._exit(0)


if __name__ == "__main__":
    import logging
    logging.basicConfig(level=logging.INFO, format=f"%(relativeCreated)d [{os.environ.get('ZEROSTALL_NODE')}] %(message)s")
    main()
