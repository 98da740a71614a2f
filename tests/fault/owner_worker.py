"""The first writer of ``test_owned_root``: owns ROOT, saves N steps, pausing inside each.

Protocol on stdin/stdout (one line each): prints ``ready PID``; for each step i, pauses at
the ``fsync_dir`` boundary (shard and manifest written in ``step-i.partial/``, not yet
renamed), prints ``inflight i`` and waits for ``go``; prints ``durable i`` once the handle
reports durable. Prints ``closed`` at the end.
"""

import os
import sys

import torch

import zerostall


def state(i):
    return {"w": torch.full((5000,), float(i)), "i": i}


def main(root, n):
    with zerostall.Checkpointer(root) as c:
        print("ready", os.getpid(), flush=True)
        step = [0]

        def hook(name):
            if name == "fsync_dir":
                print("inflight", step[0], flush=True)
                if sys.stdin.readline().strip() != "go":
                    os._exit(5)

        c.tier._hook = hook
        for i in range(n):
            step[0] = i
            rec = c.save(i, state(i)).result()
            print("durable", i, rec.ok, flush=True)
    print("closed", flush=True)


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]))
