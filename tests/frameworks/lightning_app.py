"""A tiny Lightning training job, used in-process by the tests and as a script for the runs
that need their own processes (SIGKILL mid-run, DDP with 2 gloo processes).

    python lightning_app.py OUTDIR --io zerostall|torch --epochs N [--resume PATH] [--kill-after-epoch E]
                            [--ddp]

Writes OUTDIR/final-rank<R>.pt (the final parameters, torch.save) on every rank.
"""

import argparse
import os
import signal
import sys
import time

import torch
from torch.utils.data import DataLoader, TensorDataset

import lightning as L
from lightning.pytorch.callbacks import Callback, ModelCheckpoint

sys.path.insert(0, os.path.dirname(__file__))
from kill_hook import install_kill_hook  # noqa: E402

N_SAMPLES, BATCH, DIM = 64, 8, 16  # 8 steps per epoch (4 per rank under DDP)


class TinyModel(L.LightningModule):
    def __init__(self, args: argparse.Namespace, lr: float = 0.05):
        super().__init__()
        self.save_hyperparameters()  # hparams: {"args": Namespace(...), "lr": ...}
        torch.manual_seed(args.seed)
        self.net = torch.nn.Sequential(torch.nn.Linear(DIM, 32), torch.nn.BatchNorm1d(32), torch.nn.ReLU(),
                                       torch.nn.Linear(32, 1))

    def training_step(self, batch, idx):
        x, y = batch
        loss = torch.nn.functional.mse_loss(self.net(x), y)
        self.log("train_loss", loss, on_step=False, on_epoch=True, sync_dist=True)
        return loss

    def configure_optimizers(self):
        opt = torch.optim.AdamW(self.parameters(), lr=self.hparams.lr)
        return {"optimizer": opt, "lr_scheduler": torch.optim.lr_scheduler.StepLR(opt, 2, gamma=0.5)}


class DropoutModel(TinyModel):
    """TinyModel with dropout: its masks come from the global RNG, so an exact resume needs
    the RNG state in the checkpoint."""

    def __init__(self, args: argparse.Namespace, lr: float = 0.05):
        super().__init__(args, lr)
        self.net.insert(3, torch.nn.Dropout(0.3))


def data():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(N_SAMPLES, DIM, generator=g)
    y = x[:, :4].sum(1, keepdim=True) + 0.1 * torch.randn(N_SAMPLES, 1, generator=g)
    return DataLoader(TensorDataset(x, y), batch_size=BATCH, shuffle=False)


class KillAfterEpoch(Callback):
    """SIGKILL this process as the next epoch starts: ModelCheckpoint has just handed over the
    save of ``epoch`` (it may still be in flight: then ``last.ckpt`` holds the epoch before)."""

    def __init__(self, epoch):
        self.epoch = epoch

    def on_train_epoch_start(self, trainer, pl_module):
        if trainer.current_epoch == self.epoch + 1:
            # at least one checkpoint committed (on a loaded machine the first may still be in
            # flight); the newest save may well be
            from zerostall.integrations.lightning import is_zerostall_checkpoint
            last = os.path.join(trainer.checkpoint_callback.dirpath, "last.ckpt")
            deadline = time.monotonic() + 120
            while not is_zerostall_checkpoint(last) and time.monotonic() < deadline:
                time.sleep(0.01)
            os.kill(os.getpid(), signal.SIGKILL)


def make_trainer(outdir, io, epochs, *, ddp=False, extra_callbacks=(), top_k=2):
    plugins = []
    if io == "zerostall":
        from zerostall.integrations.lightning import ZerostallCheckpointIO
        plugins.append(ZerostallCheckpointIO())
    ckpt_cb = ModelCheckpoint(dirpath=os.path.join(outdir, "ckpts"), monitor="train_loss", mode="min",
                              save_top_k=top_k, save_last=True, every_n_epochs=1,
                              filename="{epoch}-{step}")
    kw = dict(strategy="ddp", accelerator="cpu", devices=2) if ddp else dict(accelerator="cpu", devices=1)
    return L.Trainer(max_epochs=epochs, plugins=plugins, callbacks=[*extra_callbacks, ckpt_cb],
                     logger=False, enable_progress_bar=False, enable_model_summary=False,
                     deterministic=True, num_sanity_val_steps=0, **kw), ckpt_cb


def main(argv=None):
    p = argparse.ArgumentParser()
    p.add_argument("outdir")
    p.add_argument("--io", default="zerostall")
    p.add_argument("--epochs", type=int, default=4)
    p.add_argument("--resume")
    p.add_argument("--kill-after-epoch", type=int)
    p.add_argument("--ddp", action="store_true")
    p.add_argument("--seed", type=int, default=1)
    a = p.parse_args(argv)
    torch.set_num_threads(1)
    install_kill_hook(lambda: os.path.isdir(os.path.join(a.outdir, "ckpts", "last.ckpt")))
    cbs = [KillAfterEpoch(a.kill_after_epoch)] if a.kill_after_epoch is not None else []
    trainer, _ = make_trainer(a.outdir, a.io, a.epochs, ddp=a.ddp, extra_callbacks=cbs)
    model = TinyModel(argparse.Namespace(seed=a.seed, note="hparams as a Namespace"))
    trainer.fit(model, data(), ckpt_path=a.resume)
    torch.save({k: v.detach().clone() for k, v in model.state_dict().items()},
               os.path.join(a.outdir, f"final-rank{trainer.global_rank}.pt"))


if __name__ == "__main__":
    sys.exit(main())
