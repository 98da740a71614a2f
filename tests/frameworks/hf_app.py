"""A tiny Hugging Face Trainer job (GPT-2 with 1 layer, built locally; no downloads).

    python hf_app.py OUTDIR --trainer zerostall|hf --steps N [--kill-at-step K] [--resume]

Writes OUTDIR/final.pt (the final parameters). Used in-process by the tests and as a script
for the SIGKILL run.
"""

import argparse
import os
import signal
import sys
import time

import torch

from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainerCallback, TrainingArguments
from transformers.trainer_utils import get_last_checkpoint

sys.path.insert(0, os.path.dirname(__file__))
from kill_hook import install_kill_hook  # noqa: E402

SEQ, VOCAB = 16, 64


def dataset(n=48):
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, VOCAB, (n, SEQ), generator=g)
    return [{"input_ids": x, "labels": x.clone()} for x in ids]


def model():
    torch.manual_seed(0)
    cfg = GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=VOCAB, n_positions=SEQ,
                     resid_pdrop=0.1, embd_pdrop=0.1, attn_pdrop=0.1)  # dropout: the RNG matters
    return GPT2LMHeadModel(cfg)


class CountingTrainer(Trainer):
    """A Trainer subclass of the kind users and libraries (TRL) write."""

    losses_computed = 0

    def compute_loss(self, model, inputs, *args, **kwargs):
        CountingTrainer.losses_computed += 1
        return super().compute_loss(model, inputs, *args, **kwargs)


class KillAt(TrainerCallback):
    """SIGKILL this process as step ``step`` begins, once at least one checkpoint is listed
    (saves run behind training: on a loaded machine the first may still be in flight)."""

    def __init__(self, step):
        self.step = step

    def on_step_begin(self, args, state, control, **kw):
        if state.global_step == self.step:
            deadline = time.monotonic() + 120
            while get_last_checkpoint(args.output_dir) is None and time.monotonic() < deadline:
                time.sleep(0.01)
            os.kill(os.getpid(), signal.SIGKILL)


class StopAt(TrainerCallback):
    """Stop training (cleanly) after ``step``, as a preempted job that checkpointed would."""

    def __init__(self, step):
        self.step = step

    def on_step_end(self, args, state, control, **kw):
        if state.global_step == self.step:
            control.should_training_stop = True


def make_trainer(outdir, kind, steps, *, callbacks=(), save_total_limit=2):
    args = TrainingArguments(
        output_dir=str(outdir), max_steps=steps, save_steps=4, save_total_limit=save_total_limit,
        per_device_train_batch_size=4, learning_rate=1e-2, lr_scheduler_type="linear", warmup_steps=2,
        logging_steps=4, report_to=[], use_cpu=True, seed=0, data_seed=0, disable_tqdm=True,
        dataloader_num_workers=0)
    cls = Trainer
    if kind == "zerostall":
        from zerostall.integrations.transformers import ZerostallTrainer
        cls = ZerostallTrainer
    elif kind == "mixin":  # the mixin on someone else's Trainer subclass
        from zerostall.integrations.transformers import ZerostallTrainerMixin

        class MyTrainer(ZerostallTrainerMixin, CountingTrainer):
            pass
        cls = MyTrainer
    return cls(model=model(), args=args, train_dataset=dataset(), callbacks=list(callbacks))


def final_params(trainer):
    return {k: v.detach().clone() for k, v in trainer.model.state_dict().items()}


def main(argv=None):
    p = argparse.ArgumentParser()
    p.add_argument("outdir")
    p.add_argument("--trainer", default="zerostall")
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--kill-at-step", type=int)
    p.add_argument("--resume", action="store_true")
    p.add_argument("--ddp", action="store_true")
    a = p.parse_args(argv)
    if a.ddp:
        return ddp_main(a.outdir)
    torch.set_num_threads(1)
    install_kill_hook(lambda: get_last_checkpoint(a.outdir) is not None)
    cbs = [KillAt(a.kill_at_step)] if a.kill_at_step is not None else []
    t = make_trainer(a.outdir, a.trainer, a.steps, callbacks=cbs)
    t.train(resume_from_checkpoint=True if a.resume else None)
    torch.save(final_params(t), os.path.join(a.outdir, "final.pt"))



def ddp_main(outdir):
    """Under torchrun (2 gloo processes): uninterrupted vs stopped at 8 and resumed; each rank
    writes whether its final parameters are bit-identical."""
    import json

    import torch.distributed as dist
    torch.set_num_threads(1)
    full = make_trainer(os.path.join(outdir, "full"), "zerostall", 12)
    full.train()
    want = final_params(full)
    make_trainer(os.path.join(outdir, "stopped"), "zerostall", 12, callbacks=[StopAt(8)]).train()
    resumed = make_trainer(os.path.join(outdir, "stopped"), "zerostall", 12)
    resumed.train(resume_from_checkpoint=True)
    got = final_params(resumed)
    rank = dist.get_rank()
    same = all(torch.equal(want[k], got[k]) for k in want)
    with open(os.path.join(outdir, f"ddp-rank{rank}.json"), "w") as f:
        json.dump({"rank": rank, "world": dist.get_world_size(), "equal": same,
                   "step": resumed.state.global_step}, f)


if __name__ == "__main__":
    sys.exit(main())
