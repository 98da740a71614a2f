"""A tiny Accelerate training job (a dropout MLP, AdamW, a scheduler, a registered progress
object) checkpointed with ``accelerator.save_state()`` and resumed with
``accelerator.load_state()`` (automatic checkpoint naming, ``total_limit=2``).

    python accelerate_app.py OUTDIR --accelerator zerostall|accelerate --steps N [--resume]

Saves every 4 steps; writes OUTDIR/final.pt (the final parameters). ``ZS_KILL_AT`` (see
``kill_hook.install_kill_hook``) SIGKILLs it at a save's boundary.
"""

import argparse
import os
import sys

import torch

from accelerate import Accelerator
from accelerate.utils import ProjectConfiguration

sys.path.insert(0, os.path.dirname(__file__))
from kill_hook import install_kill_hook  # noqa: E402


class Progress:
    """Where the loop is: registered with ``register_for_checkpointing``."""

    def __init__(self):
        self.step = 0

    def state_dict(self):
        return {"step": self.step}

    def load_state_dict(self, sd):
        self.step = sd["step"]


def run(outdir, kind, steps, resume):
    pc = ProjectConfiguration(project_dir=str(outdir), automatic_checkpoint_naming=True, total_limit=2)
    if kind == "zerostall":
        from zerostall.integrations.accelerate import ZerostallAccelerator as cls
    else:
        cls = Accelerator
    acc = cls(cpu=True, project_config=pc)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.ReLU(), torch.nn.Dropout(0.3), torch.nn.Linear(32, 1))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    sched = torch.optim.lr_scheduler.StepLR(opt, 3, gamma=0.7)
    model, opt, sched = acc.prepare(model, opt, sched)
    progress = Progress()
    acc.register_for_checkpointing(progress)
    torch.manual_seed(1)
    if resume:
        acc.load_state()  # the newest checkpoint_<N> under OUTDIR/checkpoints
    while progress.step < steps:
        g = torch.Generator().manual_seed(100 + progress.step)  # the data: a function of the step
        x = torch.randn(16, 8, generator=g)
        loss = (model(x) - x[:, :1]).pow(2).mean()  # dropout draws from the global RNG
        acc.backward(loss)
        opt.step()
        sched.step()
        opt.zero_grad()
        progress.step += 1
        if progress.step % 4 == 0:
            acc.save_state()
    acc.end_training()
    torch.save({k: v.detach().clone() for k, v in model.state_dict().items()}, os.path.join(outdir, "final.pt"))
    return model


def main(argv=None):
    p = argparse.ArgumentParser()
    p.add_argument("outdir")
    p.add_argument("--accelerator", default="zerostall")
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--resume", action="store_true")
    a = p.parse_args(argv)
    torch.set_num_threads(1)
    ckdir = os.path.join(a.outdir, "checkpoints")
    install_kill_hook(lambda: os.path.isdir(ckdir) and bool(os.listdir(ckdir)))
    run(a.outdir, a.accelerator, a.steps, a.resume)


if __name__ == "__main__":
    sys.exit(main())
