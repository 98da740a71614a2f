"""One rank of the node-loss benchmark on shaped links (:mod:`.nodeloss_links`), inside its
node's namespace; writes one JSON result.

argv: ``mode out``. Env: ``ZS_ROOT``, ``ZS_MIB`` (MiB of state per rank), ``ZS_REPLICAS``,
``ZS_UPLOAD`` (save: space-separated tier URLs node n1 uploads its step-1 files to: the S3
server behind its own link, the shared filesystem), ``ZS_REMOTE`` (load_remote: the URL n1
fetches from).

- ``save``: step 1 saved and protected by ``ZS_REPLICAS`` nodes; n1 uploads its files;
- ``load``: the job restarted with n1's root empty: n1's files come from its peers;
- ``load_remote``: the same without peer replicas: n1 downloads its shard and the manifest
  from ``ZS_REMOTE`` first (over its link and the server's), then the collective load.

Timed alike from a barrier every rank leaves at once: ``files_s`` until n1's files are
committed in its root, ``load_s`` until its collective load returned, every byte verified.
"""

import json
import os
import sys
import time

import torch
import torch.distributed as dist

import zerostall
from zerostall import PeersConfig
from zerostall_bench.nodeloss import fetch_from  # n1's files of step 1 from a remote tier, committed


def state(rank, mib):
    g = torch.Generator().manual_seed(rank)
    n = mib << 20 >> 2
    return {f"t{i}": torch.randn(n // 8, generator=g) for i in range(8)}


def upload(root, url):
    from zerostall.store.tier import open_tier
    tier = open_tier(url)
    tier.ensure_root()
    tier.upload(os.path.join(root, "step-1", "rank-00001.shard"), "step-1/rank-00001.shard")
    tier.upload_bytes(open(os.path.join(root, "step-1", "manifest.json"), "rb").read(), "step-1/manifest.json")


def main():
    mode, out = sys.argv[1], sys.argv[2]
    root, mib = os.environ["ZS_ROOT"], int(os.environ["ZS_MIB"])
    replicas = 1 if mode == "load_remote" else int(os.environ.get("ZS_REPLICAS", 2))
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    node = os.environ["ZEROSTALL_NODE"]
    torch.set_num_threads(1)
    ck = zerostall.Checkpointer(root, dist_name="node-loss-links", replicas=replicas,
                                peers=PeersConfig(timeout_s=60, replica_timeout_s=900, cpu_priority="normal"),
                                commit_timeout_s=300, close_timeout_s=120)
    res = {"rank": rank, "node": node}
    if mode == "save":
        st = state(rank, mib)
        t0 = time.monotonic()
        h = ck.save(1, st)
        h.result()
        h.wait(tier="peers")
        res["protected"], res["protected_s"] = h.protected(), time.monotonic() - t0
        res["bytes_sent"] = ck._peers.replicator.bytes_sent
        if node == "n1":
            for url in os.environ.get("ZS_UPLOAD", "").split():
                upload(root, url)
        dist.barrier()
    else:
        st = {k: torch.empty_like(v) for k, v in state(rank, mib).items()}
        report = zerostall.LoadReport()
        if ck._peers is not None:  # a holder's repair copies (to the wiped n1) run before the clock, not in it
            ck._peers.replicator.repaired.wait(600)
        dist.barrier()
        t0 = time.monotonic()
        if mode == "load_remote" and node == "n1":
            fetch_from(os.environ["ZS_REMOTE"], ck.tier, rank)
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
    ck.close()
    with open(out, "w") as f:
        json.dump(res, f)
    os._exit(0)


if __name__ == "__main__":
    import logging
    logging.basicConfig(level=logging.INFO, format=f"%(relativeCreated)d [{os.environ.get('ZEROSTALL_NODE')}] %(message)s")
    main()
