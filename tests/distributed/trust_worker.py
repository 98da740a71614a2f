"""One rank of the multi-node trust tests (test_dist_trust.py): simulated nodes, each with
``ZEROSTALL_NODE`` and its own root; the store hosted by the test process (as torchrun's agent
does) unless the test says otherwise.

Arguments come as JSON in ``ZS_ARGS``; the rank writes ``<out>/r<rank>.json`` (results) and,
per step, ``<out>/s<step>-r<rank>.json`` (that step's outcome) as soon as it knows it.
"""

import json
import os
import sys
import threading
import time

import torch
import torch.distributed as dist

import zerostall
from zerostall.distributed import commit as commit_mod
from zerostall.distributed.commit import OutcomeUnknown


def outcome(h):
    exc = h.exception(timeout=300)
    if h.skipped:
        return {"state": "failed", "error": "skipped here"}
    if exc is None:
        return {"state": "durable"}
    return {"state": "unknown" if isinstance(exc, OutcomeUnknown) or isinstance(exc.__cause__, OutcomeUnknown)
            else "failed", "error": str(exc), "type": type(exc).__name__}


def write(path, doc):
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(doc, f)
    os.rename(tmp, path)


def install_pause(args, rank, out):
    """The fault seam: at (point, step) in ``args["pause"][rank]`` this rank announces its pid
    in ``<out>/paused-r<rank>-s<step>`` and waits for ``<out>/go-r<rank>-s<step>``; the test
    signals it by pid meanwhile (SIGKILL, or SIGSTOP ... SIGCONT)."""
    want = {(p, int(s)) for p, s in args.get("pause", {}).get(str(rank), [])}
    if not want:
        return

    def hook(point, r, step):
        if (point, step) not in want:
            return
        write(os.path.join(out, f"paused-r{rank}-s{step}"), {"pid": os.getpid(), "point": point})
        go = os.path.join(out, f"go-r{rank}-s{step}")
        while not os.path.exists(go):
            time.sleep(0.01)
    commit_mod.fault_hook = hook


def install_partition(out):
    """The store seam: from now on every request of this rank's zerostall store connections
    hangs (as over a link that is down) until ``<out>/heal`` exists."""
    from zerostall.distributed import store as store_mod
    heal = os.path.join(out, "heal")

    def hang(what):
        while not os.path.exists(heal):
            time.sleep(0.01)
    store_mod.fault_hook = hang


def state_for(rank, step, args):
    n = 1000 + (37 * rank if args.get("mode", "per_rank") == "per_rank" else 0)
    st = {"x": torch.full((n,), float(step * 10 + rank if args.get("mode", "per_rank") == "per_rank" else step)),
          "y": torch.arange(500.0) + step, "step": step}
    if args.get("bad_shape_rank") == rank:
        st["x"] = torch.full((n + 1,), float(step))
    return st


def main():
    args = json.loads(os.environ["ZS_ARGS"])
    out = args["out"]
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    root = args["roots"][rank]
    install_pause(args, rank, out)
    slow = args.get("slow_persist")  # {"steps": [...], "s": seconds}: every rank's persist of those steps is slow
    if slow:
        paused = commit_mod.fault_hook

        def hook(point, r, step, paused=paused):
            if point == "persist" and step in slow["steps"]:
                time.sleep(slow["s"])
            if paused is not None:
                paused(point, r, step)
        commit_mod.fault_hook = hook
    res = {"rank": rank, "node": os.environ.get("ZEROSTALL_NODE")}
    kw = dict(dist_mode=args.get("mode", "per_rank"), commit_timeout_s=args.get("timeout", 30),
              raise_on_background_error=False, join_timeout_s=60)
    if args.get("dist_name"):
        kw["dist_name"] = args["dist_name"]
    scenario = args["scenario"]
    if args.get("block_training_store") == rank:  # a training thread inside a blocking store wait
        blocker = dist.distributed_c10d._get_default_store()
        threading.Thread(target=lambda: blocker.wait(["zs-never-set"]), daemon=True).start()
        time.sleep(0.2)
    try:
        ck = zerostall.Checkpointer(root, **kw, **args.get("ck", {}))
    except zerostall.errors.ZerostallError as exc:
        res["init_error"], res["init_type"] = str(exc), type(exc).__name__
        write(os.path.join(out, f"r{rank}.json"), res)
        dist.barrier()
        os._exit(0)
    res["node_local"], res["groups"] = ck.session.node_local, list(ck.session.groups)
    if scenario == "steps":  # save args["steps"]; a barrier between steps unless a rank may die
        cut = args.get("partition")  # [rank, step]: that rank's store requests hang from that step's save
        for step in args["steps"]:
            if cut is not None and cut == [rank, step]:
                install_partition(out)
            h = ck.save(step, state_for(rank, step, args))
            oc = outcome(h)
            write(os.path.join(out, f"s{step}-r{rank}.json"), oc)
            res[str(step)] = oc
            if not args.get("no_barrier"):
                dist.barrier()
        if args.get("load"):  # every rank loads the newest step: the one all can, bit-exact
            rep = zerostall.LoadReport()
            got = ck.load(report=rep)
            want = state_for(rank, int(got["step"]), args)
            res["loaded"] = int(got["step"])
            res["exact"] = all(torch.equal(got[k], want[k]) for k in ("x", "y"))
    elif scenario == "skip":  # back-to-back saves; this rank's arena says "busy" for one step
        handles = {}
        # room in the staging ring for every save in flight: only the seam below makes one skip
        ck.prepare({"pad": torch.empty(3 * ck.config.staging.block_bytes // 4)})
        for step in args["steps"]:
            if rank == args.get("fail_rank") and step == args.get("fail_step"):
                try:  # an unsupported leaf: save() raises before the room agreement
                    ck.save(step, {**state_for(rank, step, args), "bad": object()})
                except zerostall.errors.ZerostallError:
                    res[str(step)] = {"state": "failed", "error": "raised here"}
                continue
            if rank == args.get("skip_rank") and step == args.get("skip_step"):
                ring = ck._lease.ring
                ring.fits_now = lambda n: False  # the seam: the ring is full right now
                handles[step] = ck.save(step, state_for(rank, step, args))
                del ring.fits_now
            else:
                handles[step] = ck.save(step, state_for(rank, step, args))
        from zerostall.distributed.commit import step_base
        for step, h in handles.items():
            res[str(step)] = outcome(h)
            res[str(step)]["interval"] = h.result().interval_steps if h.exception() is None else None
            base = step_base(ck.session, step)  # a skipped step leaves no round behind
            res[str(step)]["round_keys"] = [k for k in ("t0", "decision", f"r{rank}")
                                            if ck._committer.store.check([f"{base}/{k}"])]
    elif scenario == "leave":  # rank 0 leaves right after its with block; rank 1 reads late
        if rank == 1:
            commit_mod.fault_hook = lambda p, r, s: time.sleep(1.5) if p == "reported" else None
        with ck:
            h = ck.save(1, state_for(rank, 1, args))
            res["1"] = outcome(h)
        write(os.path.join(out, f"r{rank}.json"), res)
        os._exit(0)  # rank 0: no barrier, no teardown -- the store goes with this process
    elif scenario == "load":  # every rank loads (Checkpointer, then the library); then damage, load again
        from helpers import flip_byte
        from zerostall.format.layout import HEADER_BYTES
        rep = zerostall.LoadReport()
        got = ck.load(report=rep)
        res["loaded"], res["why"], res["x0"] = int(got["step"]), rep.why, float(got["x"][0])
        rep2 = zerostall.LoadReport()
        got2 = zerostall.load(root, report=rep2)  # auto: a per-rank checkpoint of this group
        res["lib_loaded"], res["lib_why"] = int(got2["step"]), rep2.why
        dist.barrier()
        for r, step in args.get("damage_after", []):
            if r == rank:
                flip_byte(os.path.join(root, f"step-{step}", f"rank-{rank:05d}.shard"), HEADER_BYTES + 8)
        dist.barrier()
        try:
            ck.load()
            res["second"] = None
        except zerostall.errors.ZerostallError as exc:
            res["second"], res["second_type"] = str(exc), type(exc).__name__
    res["steps"] = ck.steps()
    closed = ck.close(timeout=120)
    res["closed"] = closed
    write(os.path.join(out, f"r{rank}.json"), res)
    if args.get("no_barrier"):
        sys.stdout.flush()
        os._exit(0)
    dist.barrier()
    sys.stdout.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
