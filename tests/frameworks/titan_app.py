"""torchtitan 0.3.0's CheckpointManager with the recipe of docs/integrations.md, driven on CPU
(one gloo process; a small MLP, AdamW, a scheduler, a data position).

    python titan_app.py OUTDIR --steps N [--kill-at-save K]

Saves every 2 steps (async_mode="async", keep_latest_k=2) and resumes with the manager's own
``load()`` (its ``_find_load_step``). ``--kill-at-save K``: SIGKILL inside the K-th save, after
its shards are written and before DCP's ``.metadata`` is (the fault seam: the Writer's
``finish``). Writes OUTDIR/final.pt and OUTDIR/resumed-from.txt (the step load() restored, or -1).
"""

import argparse
import os
import re
import signal
import sys
import types

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict, set_optimizer_state_dict
from torch.distributed.checkpoint.stateful import Stateful

DOCS = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "docs",
                    "integrations.md")


def recipe():
    """The ``ZerostallCheckpointManager`` of the docs' torchtitan section (its first py block)."""
    text = open(DOCS).read()
    block = re.findall(r"```py\n(.*?)```", text[text.index("## torchtitan"):], re.S)[0]
    mod = types.ModuleType("titan_recipe")
    sys.modules[mod.__name__] = mod
    exec(compile(block, "docs/integrations.md (torchtitan recipe)", "exec"), mod.__dict__)  # noqa: S102
    return mod.ZerostallCheckpointManager


class Optim(Stateful):
    def __init__(self, model, opt):
        self.model, self.opt = model, opt

    def state_dict(self):
        return get_optimizer_state_dict(self.model, self.opt)

    def load_state_dict(self, sd):
        set_optimizer_state_dict(self.model, self.opt, sd)


class Sched(Stateful):
    def __init__(self, sched):
        self.sched = sched

    def state_dict(self):
        return self.sched.state_dict()

    def load_state_dict(self, sd):
        self.sched.load_state_dict(sd)


class Counter(Stateful):
    """The train state (step) and, as a second object, the data position."""

    def __init__(self):
        self.step = 0

    def state_dict(self):
        return {"step": torch.tensor(self.step)}

    def load_state_dict(self, sd):
        self.step = int(sd["step"])


def main(argv=None):
    p = argparse.ArgumentParser()
    p.add_argument("outdir")
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--kill-at-save", type=int)
    a = p.parse_args(argv)
    torch.set_num_threads(1)
    os.makedirs(a.outdir, exist_ok=True)
    if a.kill_at_save:
        from zerostall.integrations.dcp_writer import Writer
        finish, seen = Writer.finish, []

        def dying_finish(self, metadata, results):
            seen.append(1)
            if len(seen) == a.kill_at_save:
                os.kill(os.getpid(), signal.SIGKILL)
            return finish(self, metadata, results)

        Writer.finish = dying_finish
    Manager = recipe()
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.ReLU(), torch.nn.Linear(32, 1))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    sched = torch.optim.lr_scheduler.StepLR(opt, 2, gamma=0.5)
    train, data = Counter(), Counter()
    cfg = Manager.Config(enable=True, folder="checkpoint", interval=2, async_mode="async", keep_latest_k=2,
                         last_save_model_only=False)
    mgr = cfg.build(dataloader=data, model_parts=[model], optimizers=Optim(model, opt),
                    lr_schedulers=Sched(sched), states={"train_state": train}, sd_adapter=None,
                    base_folder=a.outdir)
    assert type(mgr) is Manager, type(mgr)
    resumed = train.step if mgr.load() else -1
    with open(os.path.join(a.outdir, "resumed-from.txt"), "w") as f:
        f.write(str(resumed))
    assert data.step == train.step
    while train.step < a.steps:
        g = torch.Generator().manual_seed(100 + data.step)
        x = torch.randn(16, 8, generator=g)
        (model(x) - x[:, :1]).pow(2).mean().backward()
        opt.step()
        sched.step()
        opt.zero_grad()
        train.step += 1
        data.step += 1
        mgr.save(train.step, last_step=train.step == a.steps)
    mgr.maybe_wait_for_saving()
    mgr.close()
    torch.save({k: v.detach().clone() for k, v in model.state_dict().items()}, os.path.join(a.outdir, "final.pt"))
    dist.destroy_process_group()


if __name__ == "__main__":
    sys.exit(main())
