"""Accelerate: ``accelerator.save_state()``/``load_state()`` through zerostall (docs/integrations.md
says what is saved, where it is staged, and what a crash leaves).

::

    accelerator = ZerostallAccelerator(project_config=ProjectConfiguration(
        project_dir="run", automatic_checkpoint_naming=True, total_limit=2))   # or the mixin
    if accelerator.zerostall_latest() is not None:
        accelerator.load_state()                                      # the newest committed one
    accelerator.save_state()                                          # returns at once
    accelerator.end_training()                                        # every save durable

Every method runs on the training thread; copy, write, commit and rename run behind it.
"""

from __future__ import annotations

import os
import re
from typing import Any

try:
    from accelerate import Accelerator
except ImportError as exc:
    raise ImportError("zerostall.integrations.accelerate needs Accelerate: "
                      "pip install 'zerostall[accelerate]'") from exc

from .. import CheckpointConfig, Checkpointer, load as _zs_load, rng_state, set_rng_state
from ..errors import CheckpointNotFound, ConfigError
from ..extend import discard
from ._common import AdapterSaves, is_committed, log, newest_committed, numbered, recover_staged, tensors_of

__all__ = ["ZerostallAccelerator", "ZerostallAcceleratorMixin"]

_STAGING_DIR = ".zerostall-staging"
_AUTO_RE = re.compile(r"^checkpoint_(\d+)$")
_AUTO_STAGED_RE = re.compile(r"^(checkpoint_\d+)$")  # in project_dir/.zerostall-staging/
_STAGED_RE = re.compile(rf"^\.(.+){re.escape(_STAGING_DIR)}$")  # beside output_dir
_NATIVE_ONLY = ("DEEPSPEED", "FSDP", "MEGATRON_LM", "XLA")


class ZerostallAcceleratorMixin:
    """Put before ``Accelerator`` in the bases. ``zerostall_config``: the checkpointers'
    :class:`~zerostall.CheckpointConfig` (default: from the environment)."""

    def __init__(self, *args: Any, zerostall_config: CheckpointConfig | None = None, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._zs_saves = AdapterSaves(zerostall_config, "zerostall-accelerate-publish")
        self._zs_recovered: set[str] = set()
        self.zerostall_handles: list[Any] = []  # the SaveHandles of the saves so far, newest last

    # -- names ----------------------------------------------------------------------------------
    def _zs_auto_dir(self) -> str:
        return os.path.join(os.path.abspath(self.project_dir), "checkpoints")

    def _zs_paths(self, output_dir: Any) -> tuple[str, str]:
        """(final, staged) directory of a save."""
        pc = self.project_configuration
        if pc.automatic_checkpoint_naming:
            final = os.path.join(self._zs_auto_dir(), f"checkpoint_{pc.iteration}")
            staged = os.path.join(os.path.abspath(self.project_dir), _STAGING_DIR, f"checkpoint_{pc.iteration}")
            return final, staged
        if output_dir is None:
            raise ConfigError("save_state() needs output_dir "
                              "(or ProjectConfiguration(automatic_checkpoint_naming=True))")
        final = os.path.abspath(os.fspath(output_dir))
        return final, os.path.join(os.path.dirname(final), f".{os.path.basename(final)}{_STAGING_DIR}")

    def zerostall_latest(self) -> str | None:
        """The newest committed ``checkpoint_<N>`` under ``project_dir/checkpoints``, or None."""
        return newest_committed(self._zs_auto_dir(), _AUTO_RE)

    # -- saving -----------------------------------------------------------------------------------
    def save_state(self, output_dir: Any = None, safe_serialization: bool = True, **kwargs: Any) -> str:
        """Start a save (see the module docstring); returns the directory it will have."""
        kind = str(getattr(self.distributed_type, "name", self.distributed_type))
        if kind in _NATIVE_ONLY:
            return super().save_state(output_dir, safe_serialization, **kwargs)  # type: ignore[misc]
        final, staged = self._zs_paths(output_dir)
        pc = self.project_configuration
        if pc.automatic_checkpoint_naming and os.path.exists(final):
            raise ConfigError(f"checkpoint directory {final} already exists (iteration {pc.iteration}); "
                              "load_state() it first, or set project_configuration.iteration")
        if self.is_main_process:
            os.makedirs(os.path.dirname(final), exist_ok=True)
        self._zs_recover(os.path.dirname(staged), os.path.dirname(final))
        self._zs_saves.drain(final)
        ck = Checkpointer(staged, self._zs_saves.config)  # creates the directory the pre-hooks are given
        weights = [self.get_state_dict(m, unwrap=False) for m in self._models]
        for hook in self._save_model_state_pre_hook.values():
            hook(self._models, weights, staged)
        state: dict[str, Any] = {
            "models": weights, "optimizers": list(self._optimizers), "schedulers": list(self._schedulers),
            "custom": list(self._custom_objects),
            "dataloaders": [dl.state_dict() if getattr(dl, "use_stateful_dataloader", False) else None
                            for dl in self._dataloaders],
            "step": int(self.step), "iteration": int(pc.iteration), "rng": rng_state()}
        if self.scaler is not None:
            state["scaler"] = self.scaler
        ck, handle = self._zs_saves.save(ck, int(pc.iteration), state, tensors_of(weights))
        self.zerostall_handles.append(handle)
        limit = pc.total_limit if pc.automatic_checkpoint_naming else None
        rotate = (lambda: self._zs_rotate(limit)) if limit else None  # the publisher's thread, once renamed
        self._zs_saves.publish(staged, final, handle, ck, after=rotate, rename=self.is_main_process)
        pc.iteration += 1
        return final

    def _zs_rotate(self, limit: int) -> None:
        found = numbered(self._zs_auto_dir(), _AUTO_RE)
        for _, path in found[:max(0, len(found) - limit)]:
            log.info("zerostall: deleting %s (total_limit=%d)", path, limit)
            discard(path)

    def _zs_recover(self, staging_parent: str, final_parent: str) -> None:
        """Once per directory: remove what a crashed run left staged (main process only)."""
        if staging_parent in self._zs_recovered or not self.is_main_process:
            return
        self._zs_recovered.add(staging_parent)
        pub = self._zs_saves.publisher
        staged = _AUTO_STAGED_RE if staging_parent.endswith(_STAGING_DIR) else _STAGED_RE
        recover_staged(staging_parent, staged, final_parent,
                       busy=lambda final: pub is not None and pub.pending(final))

    def zerostall_wait(self) -> None:
        """Block until every save is durable and published; raise the first failure."""
        self._zs_saves.wait()

    def end_training(self) -> None:
        self.zerostall_wait()
        if self.num_processes > 1:  # every checkpoint renamed before any process goes on
            self.wait_for_everyone()
        super().end_training()  # type: ignore[misc]

    # -- loading ----------------------------------------------------------------------------------
    def load_state(self, input_dir: Any = None, load_kwargs: dict | None = None, **kwargs: Any) -> None:
        """Load a checkpoint; a directory written by Accelerate's own ``save_state`` is loaded by Accelerate."""
        self._zs_saves.drain()
        if self.num_processes > 1:  # the main process renames: every one sees the same checkpoints
            self.wait_for_everyone()
        pc = self.project_configuration
        if input_dir is None:
            if not pc.automatic_checkpoint_naming:
                raise ConfigError("load_state() needs input_dir "
                                  "(or ProjectConfiguration(automatic_checkpoint_naming=True))")
            path = self.zerostall_latest()
            if path is None:
                raise CheckpointNotFound(f"no committed checkpoint_<N> in {self._zs_auto_dir()}")
        else:
            path = os.path.abspath(os.path.expanduser(os.fspath(input_dir)))
            if not is_committed(path):
                return super().load_state(path, load_kwargs, **kwargs)  # type: ignore[misc]
        for hook in self._load_model_state_pre_hook.values():
            hook(list(self._models), path)
        saved = _zs_load(path)
        if len(saved["models"]) != len(self._models) or len(saved["custom"]) != len(self._custom_objects):
            raise ConfigError(f"{path} holds {len(saved['models'])} model(s) and {len(saved['custom'])} registered "
                              f"object(s); this Accelerator has {len(self._models)} and {len(self._custom_objects)}: "
                              "prepare and register the same ones as the run that saved it")
        for objs, key in ((self._models, "models"), (self._optimizers, "optimizers"),
                          (self._schedulers, "schedulers"), (self._custom_objects, "custom")):
            for obj, sd in zip(objs, saved[key]):
                obj.load_state_dict(sd)
        for dl, sd in zip(self._dataloaders, saved["dataloaders"]):
            if sd is not None and getattr(dl, "use_stateful_dataloader", False):
                dl.load_state_dict(sd)
        if self.scaler is not None and "scaler" in saved:
            self.scaler.load_state_dict(saved["scaler"])
        self.step = saved["step"]
        set_rng_state(saved["rng"])
        if pc.automatic_checkpoint_naming:
            m = _AUTO_RE.match(os.path.basename(path))
            pc.iteration = max(int(saved["iteration"]), int(m.group(1)) if m else -1) + 1


class ZerostallAccelerator(ZerostallAcceleratorMixin, Accelerator):
    """``accelerate.Accelerator`` whose ``save_state``/``load_state`` go through zerostall."""
