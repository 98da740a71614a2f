"""One rank of test_tiers' distributed ownership test: every rank creates a Checkpointer on a
root another process owns, and reports what it raised (and how long it took)."""

import json
import sys
import time

import torch.distributed as dist

import zerostall


def main():
    ckdir, out = sys.argv[1], sys.argv[2]
    dist.init_process_group("gloo")
    t0 = time.monotonic()
    res = {"rank": dist.get_rank()}
    try:
        zerostall.Checkpointer(ckdir, commit_timeout_s=120).close()
        res["error"] = None
    except zerostall.errors.ZerostallError as exc:
        res["error"], res["type"] = str(exc), type(exc).__name__
    res["elapsed_s"] = time.monotonic() - t0
    with open(out, "w") as f:
        json.dump(res, f)
    dist.barrier()


if __name__ == "__main__":
    main()
