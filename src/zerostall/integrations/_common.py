"""Shared by the adapters: rank-local Checkpointers and guards for states a framework mutates.

Called from the training thread only (the framework's checkpoint hooks).
"""

from __future__ import annotations

import os
from typing import Any

import torch
from torch.optim.optimizer import register_optimizer_step_pre_hook

from ..checkpointer import Checkpointer
from ..config import CheckpointConfig
from ..store.tier import open_root


def is_committed(path: str | os.PathLike[str]) -> bool:
    """True when ``path`` is a directory holding at least one committed zerostall step."""
    p = os.fspath(path)
    if not os.path.isdir(p):
        return False
    # the tier's own listing: canonical step names whose manifest validates (a crash between the
    # manifest write and the rename leaves step-N.partial/manifest.json, which is not a commit)
    return bool(open_root(p).steps())


def next_step(ckpt: Checkpointer, wanted: int) -> int:
    """``wanted``, or one past the newest committed step when that is not larger (a path saved
    twice gets a new step; keep_last=1 then retires the old one after the commit)."""
    taken = ckpt.inflight_steps()
    latest = max([*taken, ckpt.latest_step() or -1])
    return wanted if wanted > latest else latest + 1


def open_local(path: str, config: CheckpointConfig) -> Checkpointer:
    """A Checkpointer that saves alone, whatever torch.distributed says (the caller is the only
    process that saves to ``path``, e.g. Lightning's rank 0)."""
    return Checkpointer(path, config.replace(dist_mode="local"))


class StateGuard:
    """While a save is being staged, make the framework's in-place updates wait for it.

    - a global optimizer step pre-hook (every ``torch.optim.Optimizer``; with a closure the
      wait happens after the closure's forward/backward);
    - a global module forward pre-hook, registered only while a snapshot is in flight, that
      waits when the module about to run owns a buffer being copied (BatchNorm statistics are
      updated in place by forward).

    ``track(ckpt, state)`` after each ``save``; ``close()`` removes the hooks.
    """

    def __init__(self) -> None:
        self._ckpts: list[Checkpointer] = []
        self._ptrs: set[int] = set()
        self._opt_hook: Any = None
        self._fwd_hook: Any = None

    def track(self, ckpt: Checkpointer, tensors: list[torch.Tensor]) -> None:
        if ckpt not in self._ckpts:
            self._ckpts.append(ckpt)
        if self._opt_hook is None:
            self._opt_hook = register_optimizer_step_pre_hook(self._on_step)
        self._ptrs.update(t.data_ptr() for t in tensors if t.numel())
        if self._fwd_hook is None:
            self._fwd_hook = torch.nn.modules.module.register_module_forward_pre_hook(self._on_forward)

    def forget(self, ckpt: Checkpointer) -> None:
        if ckpt in self._ckpts:
            self._ckpts.remove(ckpt)

    def _pending(self) -> bool:
        return any(c.snapshots_pending() for c in self._ckpts)

    def _on_step(self, opt: Any, args: Any, kwargs: Any) -> Any:
        changed = None
        for c in list(self._ckpts):
            r = c.step_pre_hook(opt, args, kwargs)
            if r is not None:
                args, kwargs = changed = r
        return changed

    def _on_forward(self, module: torch.nn.Module, args: Any) -> None:
        pending = self._pending()
        if not pending:
            self._ptrs.clear()
            if self._fwd_hook is not None:
                self._fwd_hook.remove()
                self._fwd_hook = None
            return
        for b in module._buffers.values():
            if b is not None and b.data_ptr() in self._ptrs:
                for c in self._ckpts:
                    c.wait_snapshots()
                return

    def close(self) -> None:
        for h in (self._opt_hook, self._fwd_hook):
            if h is not None:
                h.remove()
        self._opt_hook = self._fwd_hook = None
        self._ckpts.clear()
        self._ptrs.clear()


def tensors_of(tree: Any) -> list[torch.Tensor]:
    """The tensors of a nested dict/list state (for the forward guard)."""
    out: list[torch.Tensor] = []
    stack = [tree]
    while stack:
        x = stack.pop()
        if isinstance(x, torch.Tensor):
            out.append(x)
        elif isinstance(x, dict):
            stack.extend(x.values())
        elif isinstance(x, (list, tuple)):
            stack.extend(x)
    return out
