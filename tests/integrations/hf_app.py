"""A tiny Hugging Face Trainer job (GPT-2 with 1 layer, built locally; no downloads).

    python hf_app.py OUTDIR --trainer zerostall|hf --steps N [--kill-at-step K] [--resume]

Writes OUTDIR/final.pt (the final parameters). Used in-process by the tests and as a script
for the SIGKILL run.
"""

import argparse
import os
import signal
import sys

import torch

from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainerCallback, TrainingArguments

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
    def __init__(self, step):
        self.step = step

    def on_step_begin(self, args, state, control, **kw):
        if state.global_step == self.step:
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
    a = p.parse_args(argv)
    torch.set_num_threads(1)
    cbs = [KillAt(a.kill_at_step)] if a.kill_at_step is not None else []
    t = make_trainer(a.outdir, a.trainer, a.steps, callbacks=cbs)
    t.train(resume_from_checkpoint=True if a.resume else None)
    torch.save(final_params(t), os.path.join(a.outdir, "final.pt"))


if __name__ == "__main__":
    sys.exit(main())
