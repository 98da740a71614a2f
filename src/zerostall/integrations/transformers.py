"""Hugging Face ``Trainer``: checkpoints through zerostall, resumed exactly (docs/integrations.md:
what is saved, the staging in ``.checkpoint-N.zerostall-staging/``, what a crash leaves).

::

    class MyTrainer(ZerostallTrainerMixin, Trainer): ...     # or any subclass (TRL's SFTTrainer, ...)
    trainer = ZerostallTrainer(model=model, args=args, train_dataset=ds)   # the ready one
    trainer.train(resume_from_checkpoint=True)                             # newest committed checkpoint

Threads: every method runs on the trainer's thread (HF calls them from ``train()``), which waits
until every save is durable and raises a failed one.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
from typing import Any

try:
    from transformers import Trainer
    from transformers.trainer_callback import ExportableState, TrainerState
    from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR, rotate_checkpoints, sort_checkpoints
except ImportError as exc:
    raise ImportError("zerostall.integrations.transformers needs transformers: "
                      "pip install 'zerostall[transformers]'") from exc

from .. import CheckpointConfig, load as _zs_load, register_type, rng_state, set_rng_state
from ..extend import discard, write_file_durable
from ._common import AdapterSaves, is_committed, log, newest_committed, recover_staged

__all__ = ["ZerostallTrainer", "ZerostallTrainerMixin", "last_committed_checkpoint"]

register_type(TrainerState)

TRAINER_STATE_NAME = "trainer_state.json"
_CKPT_RE = re.compile(rf"^{PREFIX_CHECKPOINT_DIR}-(\d+)$")
_STAGING = ".zerostall-staging"
"""Suffix of ``.checkpoint-N`` while its save is in flight (renamed to ``checkpoint-N`` once committed)."""
_STAGED_RE = re.compile(rf"^\.({PREFIX_CHECKPOINT_DIR}-\d+){re.escape(_STAGING)}$")


def last_committed_checkpoint(run_dir: str) -> str | None:
    """The newest ``checkpoint-N`` under ``run_dir`` holding a committed zerostall step."""
    return newest_committed(run_dir, _CKPT_RE)


class ZerostallTrainerMixin:
    """Put before ``Trainer`` (or any subclass of it) in the bases; see the module docstring.
    ``zerostall_config``: the checkpointers' :class:`~zerostall.CheckpointConfig` (default: from
    the environment)."""

    def __init__(self, *args: Any, zerostall_config: CheckpointConfig | None = None, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._zs_saves = AdapterSaves(zerostall_config, "zerostall-hf-publish")
        self._zs_resume: tuple[str, dict[str, Any]] | None = None

    # -- train: resume resolution, draining ------------------------------------------------
    def train(self, resume_from_checkpoint: Any = None, *args: Any, **kwargs: Any) -> Any:
        if self.args.should_save:
            self._zs_recover(self.args.output_dir)
        if resume_from_checkpoint is True:
            resume_from_checkpoint = last_committed_checkpoint(self.args.output_dir) or True
        if isinstance(resume_from_checkpoint, (str, os.PathLike)) and is_committed(resume_from_checkpoint):
            # HF reads trainer_state.json itself: rewritten from the committed checkpoint (by
            # every rank at once: same bytes, each its own atomic rename)
            state = self._zs_loaded(os.fspath(resume_from_checkpoint))["trainer_state"]
            path = os.path.join(resume_from_checkpoint, TRAINER_STATE_NAME)
            state.save_to_json(f"{path}.{os.getpid()}.tmp")
            os.replace(f"{path}.{os.getpid()}.tmp", path)
        try:
            out = super().train(resume_from_checkpoint, *args, **kwargs)  # type: ignore[misc]
        except BaseException as exc:
            # the caller sees the training's own error; a checkpoint failure is attached to it
            try:
                self._zs_finish()
            except BaseException as cleanup:  # noqa: BLE001 - reported on the original error
                log.error("zerostall: after the training failed (%s: %s), finishing its checkpoints failed too: %s",
                          type(exc).__name__, exc, cleanup)
                exc.add_note(f"zerostall: finishing the checkpoints also failed: {type(cleanup).__name__}: {cleanup}")
            raise
        self._zs_finish()
        if self.args.world_size > 1:
            # rank 0 renames the checkpoints: no rank goes on before every one is in place
            self.accelerator.wait_for_everyone()
        return out

    def _zs_recover(self, run_dir: str) -> None:
        """Start-up: what a crashed run left staged is removed, or published when committed
        (single process only: other ranks may be choosing a checkpoint)."""
        def publish(path: str, final: str) -> bool:
            return (is_committed(path) and os.path.isfile(os.path.join(path, TRAINER_STATE_NAME))
                    and not os.path.exists(final) and self.args.world_size == 1)
        recover_staged(run_dir, _STAGED_RE, publish=publish,
                       cut_short=lambda n: n.startswith(f".deleting-.{PREFIX_CHECKPOINT_DIR}-"))

    def _zs_finish(self) -> None:
        """After train(): every save durable and published (raising the first failure), then
        HF's end-of-training rule for ``save_total_limit=1`` with a best checkpoint."""
        self._zs_resume = None
        self.zerostall_wait()
        best = self.state.best_model_checkpoint
        if self.args.should_save and best is not None and self.args.save_total_limit == 1:
            for path in sort_checkpoints(self.args.output_dir, best_model_checkpoint=best):
                if os.path.exists(best) and not os.path.samefile(path, best):
                    log.info("zerostall: deleting %s (save_total_limit=1, best model kept)", path)
                    discard(path)

    def zerostall_wait(self) -> None:
        """Block until every checkpoint is durable and published; raise the first failure."""
        self._zs_saves.wait()

    # -- saving ------------------------------------------------------------------------------
    def _save_checkpoint(self, model: Any, trial: Any) -> None:
        folder = f"{PREFIX_CHECKPOINT_DIR}-{self.state.global_step}"
        if self.hp_search_backend is None and trial is None:
            self.store_flos()
        run_dir = os.path.abspath(self._get_output_dir(trial=trial))
        output_dir = os.path.join(run_dir, folder)
        saves = self._zs_saves
        saves.drain(output_dir)  # the same folder saved twice: the first one goes first
        staging = os.path.join(run_dir, f".{folder}{_STAGING}")
        if self.state.best_global_step:
            best = os.path.join(run_dir, f"{PREFIX_CHECKPOINT_DIR}-{self.state.best_global_step}")
            if os.path.exists(best) or (saves.publisher and saves.publisher.pending(best)) or best == output_dir:
                self.state.best_model_checkpoint = best
        for cb in [c for c in self.callback_handler.callbacks + [self.control] if isinstance(c, ExportableState)]:
            name = cb.__class__.__name__
            if isinstance(self.state.stateful_callbacks.get(name), list):
                self.state.stateful_callbacks[name].append(cb.state())
            else:
                self.state.stateful_callbacks[name] = cb.state()
        state: dict[str, Any] = {"model": self.accelerator.unwrap_model(self.model).state_dict(),
                                 "trainer_state": self.state, "rng": rng_state()}
        if not self.args.save_only_model:
            state["optimizer"] = self.optimizer
            if self.lr_scheduler is not None:
                state["scheduler"] = self.lr_scheduler
            scaler = getattr(self.accelerator, "scaler", None)
            if scaler is not None:
                state["scaler"] = scaler
        ck, handle = saves.save(staging, self.state.global_step, state, list(state["model"].values()))
        if not self.args.should_save:  # the directory is rank 0's: close this rank's part only
            saves.publish(staging, output_dir, handle, ck, rename=False)
            return
        # TrainerState.save_to_json's bytes as of this step, written behind training
        text = (json.dumps(dataclasses.asdict(self.state), indent=2, sort_keys=True) + "\n").encode()
        limit, best = self.args.save_total_limit, self.state.best_model_checkpoint

        def state_json() -> None:  # the publisher's thread: durable before the rename shows the folder
            write_file_durable(os.path.join(staging, TRAINER_STATE_NAME), text)

        def rotate() -> None:  # the publisher's thread, once the rename is durable (publish_dir)
            rotate_checkpoints(output_dir=run_dir, save_total_limit=limit, best_model_checkpoint=best, use_mtime=True)

        saves.publish(staging, output_dir, handle, ck, before=state_json, after=rotate)

    # -- loading -------------------------------------------------------------------------------
    def _zs_loaded(self, checkpoint: str) -> dict[str, Any]:
        checkpoint = os.path.abspath(checkpoint)
        if self._zs_resume is None or self._zs_resume[0] != checkpoint:
            self._zs_resume = (checkpoint, _zs_load(checkpoint))
        return self._zs_resume[1]

    def _load_from_checkpoint(self, resume_from_checkpoint: str, model: Any = None) -> None:
        if not is_committed(resume_from_checkpoint):
            return super()._load_from_checkpoint(resume_from_checkpoint, model)  # type: ignore[misc]
        model = self.model if model is None else model
        model = self.accelerator.unwrap_model(model) if hasattr(self, "accelerator") else model
        result = model.load_state_dict(self._zs_loaded(resume_from_checkpoint)["model"], strict=False)
        self._issue_warnings_after_load(result)

    def _load_optimizer_and_scheduler(self, checkpoint: str | None) -> None:
        if checkpoint is None or not is_committed(checkpoint):
            return super()._load_optimizer_and_scheduler(checkpoint)  # type: ignore[misc]
        saved = self._zs_loaded(checkpoint)
        if "optimizer" in saved:
            self.optimizer.load_state_dict(saved["optimizer"])
        if "scheduler" in saved and self.lr_scheduler is not None:
            self.lr_scheduler.load_state_dict(saved["scheduler"])

    def _load_scaler(self, checkpoint: str | None) -> None:
        if checkpoint is None or not is_committed(checkpoint):
            return super()._load_scaler(checkpoint)  # type: ignore[misc]
        saved = self._zs_loaded(checkpoint)
        scaler = getattr(self.accelerator, "scaler", None)
        if "scaler" in saved and scaler is not None:
            scaler.load_state_dict(saved["scaler"])

    def _load_rng_state(self, checkpoint: str | None) -> None:
        if checkpoint is None or not is_committed(checkpoint):
            return super()._load_rng_state(checkpoint)  # type: ignore[misc]
        set_rng_state(self._zs_loaded(checkpoint)["rng"])

    def _load_best_model(self) -> None:
        self._zs_saves.drain()  # the best one may still be in flight
        best = self.state.best_model_checkpoint
        if best is None or not is_committed(best):
            return super()._load_best_model()  # type: ignore[misc]
        self._load_from_checkpoint(best)


class ZerostallTrainer(ZerostallTrainerMixin, Trainer):
    """``transformers.Trainer`` with zerostall checkpoints (see :class:`ZerostallTrainerMixin`)."""
