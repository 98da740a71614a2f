"""One rank of a multi-process test (run by test_distributed.py with torchrun-style env)."""

import json
import os
import signal
import sys

import torch
import torch.distributed as dist

import zerostall
from helpers import clone, equal
from zerostall.io import register_engine


def model_state(seed):
    torch.manual_seed(seed)
    m = torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.ReLU(), torch.nn.Linear(128, 8))
    opt = torch.optim.AdamW(m.parameters(), lr=1e-2)
    m(torch.randn(4, 64)).sum().backward()
    opt.step()
    return m, opt


class GatedTier:
    """A shared-filesystem tier whose manifest uploads wait for a gate file (the seam for
    "rank 0 is still uploading the manifest")."""

    def __new__(cls, url, **kw):
        import time as _time

        from zerostall.store.sharedfs import FileTier
        root = url.split("://", 1)[1]

        class _Gated(FileTier):
            def _put_bytes(self, data, rel):
                if rel.endswith("manifest.json"):
                    deadline = _time.monotonic() + 60
                    while not os.path.exists(root + ".gate") and _time.monotonic() < deadline:
                        _time.sleep(0.05)
                super()._put_bytes(data, rel)

        return _Gated("file://" + root, **kw)


def main():
    scenario, ckdir, out = sys.argv[1], sys.argv[2], sys.argv[3]
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    res = {"rank": rank}
    if scenario in ("per_rank", "replicated"):
        seed = 0 if scenario == "replicated" else rank
        m, opt = model_state(seed)
        with zerostall.Checkpointer(ckdir, dist_mode=scenario, commit_timeout_s=60) as ck:
            ck.guard(opt)
            state = {"model": m.state_dict(), "optim": opt.state_dict()}
            if scenario == "per_rank":
                state["rank_only"] = torch.full((10 + rank,), float(rank))
            expected = clone(state)
            h = ck.save(1, state)
            m(torch.randn(4, 64)).sum().backward()
            opt.step()  # waits for the snapshot (guard), then mutates in place
            rec = h.result()
            res["bytes"] = rec.bytes
        dist.barrier()
        with zerostall.Checkpointer(ckdir, dist_mode=scenario) as ck2:
            got = ck2.load()
        res["equal"] = equal(got, expected)
        res["files"] = sorted(os.listdir(os.path.join(ckdir, "step-1")))
    elif scenario == "remote":
        import time

        from zerostall.store.tier import register_tier
        register_tier("gatedfile", "dist_worker:GatedTier")
        root = os.environ["ZS_REMOTE_ROOT"]
        with zerostall.Checkpointer(ckdir, remote=f"gatedfile://{root}", keep_last=1, commit_timeout_s=60) as ck:
            h = ck.save(1, {"x": torch.full((1000,), float(rank))})
            res["durable"] = h.result().ok
            if rank == 1:  # own shard uploaded, manifest held back by rank 0's gate
                shard = os.path.join(root, "step-1", "rank-00001.shard")
                deadline = time.monotonic() + 60
                while not os.path.exists(shard) and time.monotonic() < deadline:
                    time.sleep(0.05)
                time.sleep(0.5)  # give a wrong implementation the time to report it
                res["shard_up"] = os.path.exists(shard)
                res["replicated_before_manifest"] = h.replicated()
                res["manifest_before"] = os.path.exists(os.path.join(root, "step-1", "manifest.json"))
                open(root + ".gate", "w").close()
            res["replicated"] = h.wait(timeout=120, tier="remote") and h.replicated()
            res["manifest_after"] = os.path.exists(os.path.join(root, "step-1", "manifest.json"))
        res["unreplicated"] = ck.unreplicated
    elif scenario in ("dcp_save", "dcp_load"):
        import torch.distributed.checkpoint as dcp
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.tensor import Replicate, Shard, distribute_tensor
        from zerostall.dcp import Reader, Writer
        mesh = init_device_mesh("cpu", (world,))
        full = torch.arange(64 * 8, dtype=torch.float32).reshape(64, 8)
        if scenario == "dcp_save":
            sd = {"w": distribute_tensor(full, mesh, [Shard(0)]),
                  "r": distribute_tensor(torch.ones(5), mesh, [Replicate()]), "extra": {"lr": 0.5}}
            dcp.save(sd, storage_writer=Writer(ckdir))
        else:
            sd = {"w": distribute_tensor(torch.zeros(64, 8), mesh, [Shard(0)]),
                  "r": distribute_tensor(torch.zeros(5), mesh, [Replicate()]), "extra": {"lr": 0.0}}
            dcp.load(sd, storage_reader=Reader(ckdir))
            res["equal"] = bool(torch.equal(sd["w"].full_tensor(), full)) and bool(
                torch.equal(sd["r"].full_tensor(), torch.ones(5))) and sd["extra"]["lr"] == 0.5
    elif scenario == "local":  # rank 0 saves alone under an initialised group; rank 1 never opens the root
        store = dist.distributed_c10d._get_default_store()
        before = store.num_keys()
        if rank == 0:
            with zerostall.Checkpointer(ckdir, dist_mode="local", join_timeout_s=2, commit_timeout_s=2) as ck:
                assert (ck.rank, ck.world_size) == (0, 1)
                state = {"w": torch.arange(10.0), "step": 1}
                ck.save(1, state).result()
                ck.save(2, dict(state, step=2)).result()
                got = ck.load()
            res["equal"] = equal(got, dict(state, step=2))
            res["steps"] = ck.steps()
            res["new_keys"] = store.num_keys() - before
    elif scenario == "absent":  # the highest rank never opens the root
        if rank < world - 1:
            import time
            t0 = time.monotonic()
            try:
                zerostall.Checkpointer(ckdir, join_timeout_s=3)
                res["error"] = None
            except zerostall.errors.ZerostallError as exc:
                res["error"], res["type"] = str(exc), type(exc).__name__
                res["missing"] = list(getattr(exc, "missing_ranks", ()))
            res["elapsed_s"] = time.monotonic() - t0
    elif scenario == "locked":  # another process owns the root: every rank fails in the start-up round
        try:
            zerostall.Checkpointer(ckdir, join_timeout_s=30, lock_timeout_s=0)
            res["error"] = None
        except zerostall.errors.ZerostallError as exc:
            res["error"], res["type"] = str(exc), type(exc).__name__
    elif scenario == "no_rank0":  # rank 0 never opens the root
        if rank > 0:
            try:
                zerostall.Checkpointer(ckdir, join_timeout_s=2)
                res["error"] = None
            except zerostall.errors.ZerostallError as exc:
                res["error"], res["type"] = str(exc), type(exc).__name__
    elif scenario == "local_fail":  # rank 1 fails in save() at step 2, rank 0 at step 4
        import time
        outcomes = {}
        with zerostall.Checkpointer(ckdir, commit_timeout_s=30, raise_on_background_error=False) as ck:
            for step in (1, 2, 3, 4, 5):
                state = {"x": torch.full((100,), float(rank + step))}
                if (step, rank) in ((2, 1), (4, 0)):
                    state["bad"] = object()  # not storable: save() raises on this rank only
                t0 = time.monotonic()
                try:
                    h = ck.save(step, state)
                    exc = h.exception(timeout=120)
                    outcomes[step] = {"error": str(exc) if exc else None}
                except zerostall.errors.ZerostallError as exc:
                    outcomes[step] = {"raised": type(exc).__name__, "error": str(exc)}
                outcomes[step]["elapsed_s"] = time.monotonic() - t0
            res["steps"] = ck.steps()
            prefix = ck._committer.session.prefix
        dist.barrier()
        store = dist.distributed_c10d._get_default_store()
        res["left_keys"] = [k for step in range(1, 6) for k in ("decision", "t0", "ack", "r1", "m0", "done/g0")
                            if store.check([f"{prefix}/s{step}/{k}"])]
        res["outcomes"] = outcomes
    elif scenario == "background_fail":  # rank 1's step 2 fails only when its objects are encoded
        import time
        outcomes = {}
        with zerostall.Checkpointer(ckdir, commit_timeout_s=30, raise_on_background_error=False) as ck:
            for step in (1, 2, 3):
                state = {"x": torch.full((100,), float(rank + step)), "cfg": list(range(20))}
                if (step, rank) == (2, 1):
                    state["cfg"][7] = 2 ** 5000  # snapshotted by save(); refused by the background encoding
                t0 = time.monotonic()
                h = ck.save(step, state)
                exc = h.exception(timeout=120)
                outcomes[step] = {"error": str(exc) if exc else None, "elapsed_s": time.monotonic() - t0}
            res["steps"] = ck.steps()
        res["outcomes"] = outcomes
    elif scenario == "kill":
        if rank == 2:
            from engines import FaultyEngine

            class Dying(FaultyEngine):
                def _wrap(self, path, fd, writable):
                    f = super()._wrap(path, fd, writable)
                    orig = f.write

                    def write(extents, overlap=None):
                        if "step-2" in path:
                            os.kill(os.getpid(), signal.SIGKILL)
                        return orig(extents, overlap)
                    f.write = write
                    return f

            register_engine("dying", lambda cfg: Dying(cfg))
            engine = "dying"
        else:
            engine = "threads"
        import time
        ck = zerostall.Checkpointer(ckdir, io=zerostall.IOConfig(engine=engine), commit_timeout_s=6,
                                    raise_on_background_error=False)
        ck.save(1, {"x": torch.full((1000,), float(rank))}).result()
        t0 = time.monotonic()
        h = ck.save(2, {"x": torch.full((1000,), 2.0 + rank)})
        exc = h.exception(timeout=60)
        res["error"] = str(exc) if exc else None
        res["elapsed_s"] = time.monotonic() - t0
        res["after"] = float(torch.ones(3).sum())  # training goes on
        res["steps"] = ck.steps()
        res["closed"] = ck.close(timeout=30)
        with open(out, "w") as f:
            json.dump(res, f)
        if rank == 0:  # rank 0 hosts the store: stay until rank 1 has its result
            peer = out.replace("rank0.json", "rank1.json")
            deadline = time.monotonic() + 60
            while not os.path.exists(peer) and time.monotonic() < deadline:
                time.sleep(0.05)
        os._exit(0)  # a peer is dead: skip process-group teardown
    with open(out, "w") as f:
        json.dump(res, f)
    dist.barrier()
    dist.destroy_process_group()
    # Results are written and every rank passed the barrier; skip interpreter teardown, where
    # torch's device-mesh/gloo background threads occasionally abort ("terminate called without
    # an active exception") after the work is done.
    sys.stdout.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
