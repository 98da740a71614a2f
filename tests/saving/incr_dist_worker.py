"""One rank of a multi-rank incremental test (run by test_incremental_dist.py, torchrun-style env).

Rank 0 trains a head on a frozen base (its head and optimizer state change every step); rank 1
holds only frozen tensors (nothing changes). Arguments: ckdir, out (JSON written here).
Environment: ZS_MODE ("crc" or "version"), ZS_DIST_MODE ("per_rank" or "replicated"),
ZS_REMOTE (optional remote URL), ZS_KEEP_LAST.
"""

import json
import os
import sys

import torch
import torch.distributed as dist

import zerostall
from helpers import clone, equal


def _rank0_model():
    torch.manual_seed(0)
    m = torch.nn.Sequential(torch.nn.Embedding(256, 64), torch.nn.Linear(64, 8))
    m[0].weight.requires_grad_(False)  # frozen base
    opt = torch.optim.AdamW([p for p in m.parameters() if p.requires_grad], lr=1e-2)
    return m, opt


def _train(m, opt, step):
    x = torch.randint(0, 256, (8, 4), generator=torch.Generator().manual_seed(step))
    m(x).pow(2).mean().backward()
    opt.step()
    opt.zero_grad()


def main():
    ckdir, out = sys.argv[1], sys.argv[2]
    mode = {"crc": True, "version": "version"}[os.environ.get("ZS_MODE", "crc")]
    dist_mode = os.environ.get("ZS_DIST_MODE", "per_rank")
    remote = os.environ.get("ZS_REMOTE") or None
    keep_last = int(os.environ.get("ZS_KEEP_LAST", "4"))
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    res = {"rank": rank, "records": {}}
    if dist_mode == "replicated":  # the same state on every rank; each rank writes its share
        m, opt = _rank0_model()
        frozen = {"tower": torch.arange(40000, dtype=torch.float32)}
    elif rank == 0:
        m, opt = _rank0_model()
        frozen = {}
    else:
        m, opt = None, None
        torch.manual_seed(1)
        frozen = {"tower": torch.randn(128, 256), "norm": torch.ones(256)}

    def state(step):
        sd = {"frozen": frozen, "step": step}
        if m is not None:
            sd["model"], sd["optim"] = m.state_dict(), opt.state_dict()
        return sd

    expected = {}
    opts = dict(incremental=mode, full_every=4, keep_last=keep_last, dist_mode=dist_mode, commit_timeout_s=60)
    if remote:
        opts.update(remote=remote, keep_last_remote=1, close_timeout_s=120)

    def run(ck, steps):
        for step in steps:  # one at a time: a save references the last *committed* step
            if m is not None:
                _train(m, opt, step)
            h = ck.save(step, state(step))
            rec = h.result()
            res["records"][step] = {"written": rec.bytes_written, "referenced": rec.bytes_referenced,
                                    "bytes": rec.bytes}
            expected[step] = clone(state(step))
        return h

    with zerostall.Checkpointer(ckdir, **opts) as ck:
        h = run(ck, range(1, 7))
        ck.wait()
        if remote:
            res["replicated"] = h.wait(timeout=120, tier="remote") and h.replicated()
        res["steps_before_restart"] = ck.steps(include_remote=False)
    dist.barrier()
    with zerostall.Checkpointer(ckdir, **opts) as ck:  # a restart: each rank's base comes from disk
        run(ck, [200])
        ck.wait()
    res["unreplicated"] = ck.unreplicated
    dist.barrier()  # every rank closed: rank 0's retention after step 200 is done
    from zerostall.store.local import LocalTier
    res["steps"] = LocalTier(ckdir).steps()
    dist.barrier()  # before rank 0 may remove the directory (remote case)
    if remote:
        import shutil
        if rank == 0:
            shutil.rmtree(ckdir)
        dist.barrier()
        fresh = ckdir + "-fresh"
        got = zerostall.load(fresh, remote=remote, rank=rank, world_size=dist.get_world_size())
        res["remote_equal"] = equal(got, expected[200])
    else:
        res["equal"] = {s: equal(zerostall.load(ckdir, step=s, rank=rank, world_size=2), expected[s])
                        for s in res["steps"]}
    with open(out, "w") as f:
        json.dump(res, f)
    # Leave without a last collective (a gloo barrier lets one rank leave while the other still
    # reads its final message: "Connection closed by peer"): rank 0 hosts the store, so it
    # leaves last, once every rank has said it is done; no interpreter teardown (dist_worker.py).
    store = dist.distributed_c10d._get_default_store()
    store.set(f"incr-exit/{rank}", "1")
    if rank == 0:
        import datetime
        try:
            store.wait([f"incr-exit/{r}" for r in range(dist.get_world_size())], datetime.timedelta(seconds=60))
        except Exception:  # noqa: BLE001 - a rank that failed has said so on its stderr
            pass
    sys.stdout.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
