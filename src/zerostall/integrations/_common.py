"""Shared by the adapters: rank-local Checkpointers, guards for states a framework mutates,
and the publisher that shows a staged checkpoint under the framework's name once committed.

Called from the training thread only (the framework's checkpoint hooks), except
:class:`Publisher`'s own thread.
"""

from __future__ import annotations

import atexit
import logging
import os
import threading
from dataclasses import dataclass
from typing import Any, Callable

import torch
from torch.optim.optimizer import register_optimizer_step_pre_hook

from .. import CheckpointConfig, Checkpointer
from ..errors import ConfigError, ZerostallError
from ..extend import RootLock, Worker, discard, open_root, publish_dir

log = logging.getLogger("zerostall")


def is_committed(path: str | os.PathLike[str]) -> bool:
    """True when ``path`` is a directory holding at least one committed zerostall step."""
    p = os.fspath(path)
    if not os.path.isdir(p):
        return False
    # the tier's own listing: canonical step names whose manifest validates (a crash between the
    # manifest write and the rename leaves step-N.partial/manifest.json, which is not a commit)
    return bool(open_root(p).steps())


def unowned(path: str) -> bool:
    """Whether no live writer holds ``path``'s root lock (taken and let go at once), so an
    earlier run's leftover there may be removed or published; a held one is logged and left
    alone. Training thread (start-up cleanup)."""
    lock = RootLock(path)
    try:
        lock.acquire(0.0)
    except ZerostallError as exc:  # a live writer there (another job)
        log.warning("zerostall: leaving %s alone: %s", path, exc)
        return False
    lock.release()
    return True


def recover_staged(parent: str, final_of: Callable[[str], str | None],
                   publish: Callable[[str, str], bool] = lambda staged, final: False,
                   cut_short: Callable[[str], bool] = lambda name: False) -> None:
    """Start-up, the training thread of the one process that publishes: each save an earlier run
    left staged in ``parent`` (``final_of(name)``: the checkpoint directory the entry ``name``
    was to become, None for anything else) that no live writer holds is published there when
    ``publish(staged, final)`` (committed, the run stopped before renaming it), else removed;
    entries ``cut_short(name)`` (a discard a crash interrupted) are removed."""
    try:
        names = os.listdir(parent)
    except FileNotFoundError:
        return
    for n in names:
        path = os.path.join(parent, n)
        if cut_short(n):
            discard(path)
            continue
        final = final_of(n)
        if final is None or not unowned(path):  # not a staged save, or a live writer's (another job)
            continue
        if publish(path, final):
            log.info("zerostall: publishing %s as %s (committed; the run stopped before renaming it)", path, final)
            publish_dir(path, final)
        else:
            log.info("zerostall: removing %s, a save of an earlier run that was not published", path)
            discard(path)


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


def load_torch_file(path: str, map_location: Any) -> dict[str, Any]:
    """A ``torch.save`` checkpoint dict (e.g. a run begun with Lightning's own checkpointing), read with
    ``torch.load(weights_only=True)``: tensors, containers, plain values and
    ``argparse.Namespace`` (Lightning's usual hyper-parameters); never an unrestricted unpickle."""
    import argparse
    import pickle
    try:
        with torch.serialization.safe_globals([argparse.Namespace]):
            out = torch.load(path, map_location=map_location, weights_only=True)
    except pickle.UnpicklingError as exc:
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise ConfigError(f"{path} is a torch.save checkpoint that a weights-only load refuses ({first}); "
                          "zerostall never unpickles arbitrary objects: allow the type with "
                          "torch.serialization.add_safe_globals([...]) if you trust the file") from None
    if not isinstance(out, dict):
        raise ConfigError(f"{path} holds a {type(out).__name__}, not a Lightning checkpoint dict")
    return out


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

    def forget_done(self) -> None:
        """Stop tracking Checkpointers with nothing in flight (closed by a :class:`Publisher`)."""
        self._ckpts = [c for c in self._ckpts if c.inflight_steps()]

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


@dataclass(frozen=True)
class _Publish:
    staged: str  # the Checkpointer's root (a name the framework does not list)
    final: str  # the framework's name for it
    handle: Any  # the SaveHandle of the save into ``staged``
    ckpt: Checkpointer  # closed by the publisher once the save is done
    before: Callable[[], None] | None  # runs just before the rename (the publisher's thread)
    after: Callable[[], None] | None  # runs after it (e.g. retention)
    rename: bool  # False: close only (a rank that does not own the directory)


class Publisher(Worker[Any]):
    """Shows a staged checkpoint directory under the framework's name once it is committed.

    The framework's own "latest checkpoint" discovery (HF ``get_last_checkpoint``, Lightning
    ``ckpt_path="last"``) lists names; a directory under such a name that holds no committed
    step (a process killed during its first save) stops a resume. So a save goes into
    ``staged`` (a hidden sibling); this thread waits until it is committed, closes its
    Checkpointer, and renames ``staged`` to ``final`` (``publish_dir``: rename, or an atomic
    exchange with a previous copy), so a listed name always holds a committed checkpoint.
    A failed save's directory is removed; its error is kept for :meth:`drain`.

    ``submit`` and ``cancel`` from the training thread; one daemon thread publishes, in
    submission order. ``_hook`` is the crash-test seam: called with ``"publish"`` just
    before each rename.
    """

    _hook: Callable[[str], None] | None = None

    def __init__(self, name: str = "zerostall-publish"):
        super().__init__(name)
        self._mu = threading.Lock()
        self._pending: dict[str, int] = {}  # final -> saves queued for it
        self._cancelled: set[str] = set()
        self._errors: list[BaseException] = []
        atexit.register(self.drain)  # an interpreter exiting first publishes what committed

    def close(self) -> None:
        """Drain, then stop the thread (errors stay readable with :meth:`errors`)."""
        atexit.unregister(self.drain)
        self.drain()
        self.stop()

    def submit(self, staged: str, final: str, handle: Any, ckpt: Checkpointer, *,
               before: Callable[[], None] | None = None, after: Callable[[], None] | None = None,
               rename: bool = True) -> None:
        with self._mu:
            self._pending[final] = self._pending.get(final, 0) + 1
            self._cancelled.discard(final)
        super().submit(_Publish(staged, final, handle, ckpt, before, after, rename))

    def pending(self, final: str) -> bool:
        """Whether a save for ``final`` is still queued (not yet published or dropped)."""
        with self._mu:
            return self._pending.get(final, 0) > 0

    def cancel(self, final: str) -> None:
        """The framework removed ``final`` while its save was queued: drop it, not publish it."""
        with self._mu:
            if self._pending.get(final, 0):
                self._cancelled.add(final)

    def drain(self) -> None:
        """Block until everything submitted so far is published or dropped."""
        done = threading.Event()
        Worker.submit(self, done)
        done.wait()

    def errors(self) -> list[BaseException]:
        """The failures since the last call (failed saves, failed renames), oldest first."""
        with self._mu:
            out, self._errors = self._errors, []
        return out

    def handle(self, item: Any) -> None:
        if isinstance(item, threading.Event):
            item.set()
            return
        p: _Publish = item
        try:
            p.handle.wait()
            failed = p.handle.exception()
            try:
                p.ckpt.close()
            except ZerostallError as exc:
                failed = failed or exc
            with self._mu:
                cancelled = p.final in self._cancelled
            if not p.rename:
                return
            if failed is not None or cancelled:
                discard(p.staged)
                if failed is not None:
                    raise failed
                return
            if p.before is not None:
                p.before()
            if self._hook is not None:
                self._hook("publish")
            publish_dir(p.staged, p.final, overwrite=True)
            if p.after is not None:
                p.after()
        except BaseException as exc:  # noqa: BLE001 - kept for drain(), never lost in the thread
            log.error("zerostall: checkpoint %s was not published: %s", p.final, exc)
            with self._mu:
                self._errors.append(exc)
        finally:
            with self._mu:
                n = self._pending.get(p.final, 1) - 1
                if n > 0:
                    self._pending[p.final] = n
                else:
                    self._pending.pop(p.final, None)
                    self._cancelled.discard(p.final)



def adapter_config(zerostall_config: CheckpointConfig | None) -> CheckpointConfig:
    """The config of the Accelerate and Transformers adapters' checkpointers: the user's (or
    the environment's) with ``keep_last=1`` and never overwrite (a path saved twice gets a new
    step, see :func:`next_step`)."""
    cfg = zerostall_config if zerostall_config is not None else CheckpointConfig.from_env()
    return cfg.replace(keep_last=1, overwrite=False)


def finish_publishing(guard: StateGuard, pub: Publisher | None) -> None:
    """Block until every save is durable and published, then raise the first failure (the
    others are logged): the adapters' ``zerostall_wait``. Training thread."""
    guard.close()
    if pub is None:
        return
    pub.close()
    errors = pub.errors()
    for exc in errors[1:]:
        log.error("zerostall: a checkpoint save failed: %s", exc)
    if errors:
        raise errors[0]
