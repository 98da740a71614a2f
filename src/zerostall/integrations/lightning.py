"""Lightning: ``ZerostallCheckpointIO``, a ``CheckpointIO`` plugin that saves through zerostall
(docs/integrations.md: what a save stages where, what a crash leaves, how ``torch.save`` runs continue).

::

    trainer = lightning.Trainer(plugins=[ZerostallCheckpointIO()], callbacks=[ModelCheckpoint(...)])
    trainer.fit(model, ckpt_path="last")          # resume: unchanged

A removed path is renamed to ``.NAME.zerostall-removing`` at once and deleted once every save in
flight is durable. Threads: Lightning calls ``save_checkpoint``/``remove_checkpoint`` on global
rank 0 only (``load_checkpoint`` on every rank), from the training thread; until a snapshot is
copied, optimizer steps and the forward of a module whose buffers are being copied wait
(:class:`~._common.StateGuard`).
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import threading
from typing import Any

import torch

from ..errors import ConfigError, ZerostallError
from ..extend import discard
from ._common import (AdapterSaves, is_committed, load_torch_file, log, names_in, next_step, owned,
                      recover_staged, tensors_of)
from .. import CheckpointConfig, Checkpointer, load, rng_state, set_rng_state

try:
    from lightning.fabric.plugins.io.checkpoint_io import CheckpointIO
    _PL = "lightning.pytorch"
except ImportError:  # the standalone pytorch_lightning package
    try:
        from lightning_fabric.plugins.io.checkpoint_io import CheckpointIO  # type: ignore[no-redef]
        _PL = "pytorch_lightning"
    except ImportError as exc:
        raise ImportError("zerostall.integrations.lightning needs Lightning: pip install 'zerostall[lightning]'"
                          ) from exc

_REMOVING = ".zerostall-removing"  # a path Lightning removed, deleted once the saves in flight are durable
_REPLACED = ".zerostall-replaced"  # a torch.save file an earlier version set aside while a save replaced it
_FIRST = ".zerostall-first"  # a path's first save, renamed to the path once committed
_FIRST_RE = re.compile(rf"^\.(.+){re.escape(_FIRST)}$")
RNG_KEY = "zerostall_rng"

__all__ = ["ZerostallCheckpointIO", "is_zerostall_checkpoint", "load_from_checkpoint"]


is_zerostall_checkpoint = is_committed


def _aside(root: str, suffix: str) -> str:
    """The hidden sibling ``.NAME<suffix>`` of the path ``root``."""
    return os.path.join(os.path.dirname(root), f".{os.path.basename(root)}{suffix}")


class ZerostallCheckpointIO(CheckpointIO):
    """Lightning ``CheckpointIO`` over zerostall. ``config``/``overrides``:
    :class:`~zerostall.CheckpointConfig` fields for the Checkpointers (the plugin sets ``keep_last``
    and ``dist_mode``, and refuses ``remote``). ``wait_staged``: block in ``save_checkpoint``
    until the snapshot is copied."""

    def __init__(self, config: CheckpointConfig | None = None, *, wait_staged: bool = False,
                 **overrides: Any) -> None:
        overrides["dist_mode"] = "local"  # rank 0 saves alone
        self._saves = AdapterSaves(config, "zerostall-lightning-publish", **overrides)
        self.config = self._saves.config
        if self.config.remote:
            raise ConfigError("ZerostallCheckpointIO(remote=...) is not supported: replicate the checkpoint "
                              "directory with zerostall.Checkpointer or a sync job instead")
        self.wait_staged = wait_staged
        self._ckpts: dict[str, Any] = {}
        self._removers: list[threading.Thread] = []
        self._cleaned: set[str] = set()
        self._waiting: set[str] = set()  # trash paths whose remover waits for saves in flight
        self._errors: list[BaseException] = []
        self.handles: list[Any] = []
        """SaveHandles of the saves since the last teardown (newest last)."""

    # -- Lightning's interface (training thread) -------------------------------------------
    def save_checkpoint(self, checkpoint: dict[str, Any], path: Any, storage_options: Any | None = None) -> None:
        if storage_options is not None:
            raise TypeError("ZerostallCheckpointIO.save_checkpoint does not take storage_options")
        root = os.path.abspath(os.fspath(path))
        self._clean_stale_trash(os.path.dirname(root))  # before anything of ours is set aside
        self._saves.drain(root)  # its first save is still in flight: it goes first
        checkpoint = {**checkpoint, RNG_KEY: rng_state()}
        ck, staged = self._ckpts.get(root), None
        if ck is None and is_committed(root):
            ck = self._ckpts[root] = Checkpointer(root, self.config)
        elif ck is None:  # nothing committed there yet: written aside, shown under its name once committed
            staged = _aside(root, _FIRST)
            if os.path.lexists(staged):
                discard(staged)
            ck = Checkpointer(staged, self.config)
        try:
            step = next_step(ck, int(checkpoint.get("global_step", 0) or 0))
            self._close_idle(keep=root)
            handle = ck.save(step, checkpoint)
        except BaseException:
            if staged is not None:
                ck.close()
                discard(staged)
            raise
        self.handles.append(handle)
        if staged is not None:
            self._saves.publish(staged, root, handle, ck)
        if self.wait_staged:
            self._saves.guard.forget_done()
            handle.wait_staged()
        else:
            self._saves.guard.track(ck, tensors_of(checkpoint.get("state_dict", {})))

    def load_checkpoint(self, path: Any, map_location: Any | None = None,
                        weights_only: bool | None = None) -> dict[str, Any]:
        root = os.path.abspath(os.fspath(path))
        ck = self._ckpts.get(root)
        if ck is not None:
            ck.wait()
        self._saves.drain(root)
        # resuming runs load before the save-time cleanup runs
        self._settle_replaced(root, _aside(root, _REPLACED))
        out = (load_torch_file if os.path.isfile(root) else _load)(root, map_location)
        rng = out.pop(RNG_KEY, None)
        if isinstance(rng, dict):
            set_rng_state(rng)
        return out

    def remove_checkpoint(self, path: Any) -> None:
        root = os.path.abspath(os.fspath(path))
        self._saves.drain(root)  # removed right after its first save: published, then set aside
        ck = self._ckpts.pop(root, None)
        if ck is not None:
            self._saves.guard.forget(ck)
            self._close(ck)
        if os.path.islink(root) or os.path.isfile(root):
            os.remove(root)
            return
        if not os.path.isdir(root):
            return
        # the bytes go once every save in flight is durable: a crash never leaves fewer checkpoints
        trash = self._trash_name(root)
        os.rename(root, trash)
        self._remove_after(trash, [h for h in self.handles if not h.done()])

    def teardown(self) -> None:
        """Wait until every save is durable, release the arenas, raise the first failure."""
        for ck in list(self._ckpts.values()):
            self._close(ck)
        self._ckpts.clear()
        self._errors.extend(self._saves.finish())
        for t in self._removers:
            t.join()
        self._removers.clear()
        self.handles = [h for h in self.handles if not h.done()]
        errors, self._errors = self._errors, []
        if errors:
            raise errors[0]

    # -- internals ----------------------------------------------------------------------------
    def _trash_name(self, root: str) -> str:
        trash = _aside(root, _REMOVING)
        n = 0
        while trash in self._waiting:  # set aside by this run and waiting for saves: never early
            n += 1
            trash = _aside(root, f".{n}{_REMOVING}")
        _remove(trash)
        return trash

    def _remove_after(self, trash: str, pending: list[Any]) -> None:
        """Delete ``trash`` once the ``pending`` saves are done."""

        def remove() -> None:
            try:
                for h in pending:
                    h.wait()
                _remove(trash)
            finally:
                self._waiting.discard(trash)

        self._waiting.add(trash)
        if all(h.done() for h in pending):
            remove()
            return
        t = threading.Thread(target=remove, name="zerostall-lightning-remove", daemon=True)
        t.start()
        self._removers.append(t)

    def _clean_stale_trash(self, directory: str) -> None:
        """Remove what a crashed run left set aside (once per directory and plugin)."""
        if directory in self._cleaned or any(t.is_alive() for t in self._removers):
            return
        self._cleaned.add(directory)
        # a first save a crash cut short is removed, never published: a name appearing under a
        # started ModelCheckpoint makes it save last-v1.ckpt instead of last.ckpt
        recover_staged(directory, _FIRST_RE)
        for n in names_in(directory):
            if n.startswith(".") and n.endswith(_REMOVING):
                log.info("zerostall: removing %s, left aside by an earlier run", os.path.join(directory, n))
                self._trash_name(os.path.join(directory, n[1:-len(_REMOVING)]))
            elif n.startswith(".") and n.endswith(_REPLACED):  # the previous checkpoint of a path
                self._settle_replaced(os.path.join(directory, n[1:-len(_REPLACED)]), os.path.join(directory, n))

    def _settle_replaced(self, root: str, replaced: str) -> None:
        """``replaced`` held ``root``'s previous checkpoint while a save replaced it: removed if
        ``root`` is now committed, else put back (over the failed save's directory). An OSError
        is logged, never raised."""
        if not os.path.lexists(replaced):
            return
        try:
            if is_committed(root):
                _remove(replaced)
                return
            if os.path.isdir(root) and not os.path.islink(root):
                with owned(root) as mine:  # held while removing: a writer starting there meanwhile is refused
                    if not mine:  # a live writer there (owned() logged why): both stay as they are
                        log.warning("zerostall: %s was not put back at %s; it stays where it is", replaced, root)
                        return
                    shutil.rmtree(root)
            if os.path.lexists(root):
                log.warning("zerostall: %s holds something else now; the previous checkpoint stays at %s",
                            root, replaced)
                return
            os.rename(replaced, root)
        except OSError as exc:
            log.warning("zerostall: could not settle %s: %s", replaced, exc)
            return
        log.warning("zerostall: the save that replaced %s never committed; the previous checkpoint is back there",
                    root)

    def _close(self, ck: Any) -> None:
        try:
            ck.close()
        except ZerostallError as exc:
            log.error("zerostall: a Lightning checkpoint save failed: %s", exc)
            self._errors.append(exc)

    def _close_idle(self, keep: str) -> None:
        """Close the Checkpointers of other paths once their saves are done (frees arenas)."""
        for root, ck in list(self._ckpts.items()):
            if root != keep and not ck.inflight_steps():
                del self._ckpts[root]
                self._saves.guard.forget(ck)
                self._close(ck)


def _remove(path: str) -> None:
    """Delete ``path`` (a directory, file or link) if it is still there."""
    if os.path.isdir(path) and not os.path.islink(path):
        shutil.rmtree(path, ignore_errors=True)
    else:
        with contextlib.suppress(FileNotFoundError):
            os.remove(path)


def _load(root: str, map_location: Any) -> dict[str, Any]:
    """The zerostall checkpoint at ``root``, whole (Lightning's global rank 0 saved it alone)."""
    loc = map_location if isinstance(map_location, (str, torch.device)) else None
    return load(root, map_location=loc, rank=0, world_size=1)


def load_from_checkpoint(cls: Any, checkpoint_path: Any, map_location: Any = None, hparams_file: Any = None,
                         strict: bool | None = None, weights_only: bool | None = None, **kwargs: Any) -> Any:
    """``cls.load_from_checkpoint(path, ...)`` for a zerostall checkpoint (a LightningModule or
    LightningDataModule class); Lightning's own loader for ``torch.save`` files."""
    root = os.fspath(checkpoint_path)
    if not is_zerostall_checkpoint(root):
        return cls.load_from_checkpoint(root, map_location=map_location, hparams_file=hparams_file,
                                        strict=strict, weights_only=weights_only, **kwargs)
    import importlib
    saving = importlib.import_module(f"{_PL}.core.saving")
    pl = importlib.import_module(_PL)
    checkpoint = _load(root, map_location)
    if hparams_file is not None:
        ext = str(hparams_file).rsplit(".", 1)[-1].lower()
        hp = saving.load_hparams_from_tags_csv(hparams_file) if ext == "csv" else \
            saving.load_hparams_from_yaml(hparams_file)
        checkpoint[cls.CHECKPOINT_HYPER_PARAMS_KEY] = hp
    checkpoint.setdefault(cls.CHECKPOINT_HYPER_PARAMS_KEY, {})
    checkpoint[cls.CHECKPOINT_HYPER_PARAMS_KEY].update(kwargs)
    if issubclass(cls, pl.LightningDataModule):
        return saving._load_state(cls, checkpoint, **kwargs)
    return saving._load_state(cls, checkpoint, strict=strict, **kwargs)
