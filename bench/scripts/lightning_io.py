"""How long Lightning's training thread is blocked per checkpoint: TorchCheckpointIO (sync),
AsyncCheckpointIO (clones every tensor on the training thread) and ZerostallCheckpointIO.

    python bench/scripts/lightning_io.py [--mparams 25] [--saves 6] [--dir D] [--overlap]

Each save goes to a new path (the ModelCheckpoint top-k pattern) and is followed at once by
an optimizer step (no forward/backward in between to overlap: the worst case for zerostall;
``--overlap`` runs a forward/backward-sized matmul workload first, as a training step would).
Blocked = time inside save_checkpoint + the time the next optimizer step waited for the
snapshot (zerostall's guard; measured by the guard itself, not by step-time differences).
Reports medians over the saves (the first save of each method is included: it allocates).
"""

import argparse
import os
import shutil
import statistics
import tempfile
import time

import torch
from lightning.fabric.plugins.io.torch_io import TorchCheckpointIO
from lightning.pytorch.plugins.io.async_plugin import AsyncCheckpointIO

from zerostall.integrations.lightning import ZerostallCheckpointIO


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--mparams", type=float, default=25)
    p.add_argument("--saves", type=int, default=6)
    p.add_argument("--dir", default=None)
    p.add_argument("--overlap", action="store_true")
    a = p.parse_args()
    x = torch.randn(1024, 1024)

    def forward_backward():
        for _ in range(20):
            x @ x
    n = int(a.mparams * 1e6) // 4096 * 4096
    model = torch.nn.ParameterList([torch.nn.Parameter(torch.randn(n // 8, 8)) for _ in range(4)])
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)

    def step():
        for q in model:
            q.grad = torch.ones_like(q)
        opt.step()

    step()
    gb = 3 * 4 * sum(q.numel() for q in model) / 1e9
    print(f"state {gb:.2f} GB (fp32 weights + AdamW moments), {a.saves} saves per method, each to a new path")
    root = a.dir or tempfile.mkdtemp(prefix="zs-lightning-io-")
    for name, io in (("TorchCheckpointIO (sync)", TorchCheckpointIO()),
                     ("AsyncCheckpointIO", AsyncCheckpointIO(TorchCheckpointIO())),
                     ("ZerostallCheckpointIO", ZerostallCheckpointIO())):
        d = os.path.join(root, name.split()[0])
        blocked = []
        t_all = time.perf_counter()
        for i in range(a.saves):
            ckpt = {"state_dict": {f"p{j}": q.detach() for j, q in enumerate(model)},
                    "optimizer_states": [opt.state_dict()], "global_step": i}
            t0 = time.perf_counter()
            io.save_checkpoint(ckpt, os.path.join(d, f"step={i}.ckpt"))
            blocked.append(time.perf_counter() - t0)
            if a.overlap:
                forward_backward()
            step()
        if isinstance(io, ZerostallCheckpointIO):
            waits = [h._job.status.guard_wait_s for h in io.handles]
        io.teardown()
        if isinstance(io, ZerostallCheckpointIO):
            blocked = [b + w for b, w in zip(blocked, waits)]
        total = time.perf_counter() - t_all
        print(f"{name:26s} blocked per save: median {statistics.median(blocked) * 1e3:7.1f} ms, "
              f"first {blocked[0] * 1e3:7.1f} ms, max {max(blocked) * 1e3:7.1f} ms; "
              f"all {a.saves} saves durable after {total:.1f} s")
        shutil.rmtree(d, ignore_errors=True)
    if a.dir is None:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
