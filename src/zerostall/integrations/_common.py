"""Shared by the adapters: their saving state (:class:`AdapterSaves`), the guard for states a
framework mutates, and the publisher that shows a staged checkpoint under the framework's name
once committed. Training thread only (the framework's hooks), except :class:`Publisher`'s own.
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
import threading
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable, Iterator

import torch
from torch.optim.optimizer import register_optimizer_step_pre_hook

from .. import CheckpointConfig, Checkpointer
from ..errors import ConfigError, ZerostallError
from ..extend import RootLock, discard, open_root, publish_dir

log = logging.getLogger("zerostall")


def is_committed(path: str | os.PathLike[str]) -> bool:
    """True when ``path`` is a directory holding at least one committed zerostall step."""
    p = os.fspath(path)  # steps(): committed ones (step-N.partial/manifest.json is not a commit)
    return os.path.isdir(p) and bool(open_root(p).steps())


def names_in(parent: str) -> list[str]:
    """The entries of the directory ``parent``; [] when there is none."""
    with contextlib.suppress(FileNotFoundError):
        return os.listdir(parent)
    return []


def numbered(parent: str, pattern: re.Pattern[str]) -> list[tuple[int, str]]:
    """(N, path) of the entries of ``parent`` whose name ``pattern`` matches (N: its group 1), ascending."""
    return sorted((int(m.group(1)), os.path.join(parent, n))
                  for n in names_in(parent) if (m := pattern.match(n)))


def newest_committed(parent: str, pattern: re.Pattern[str]) -> str | None:
    """The newest of :func:`numbered`'s entries holding a committed zerostall step, or None."""
    return next((path for _, path in reversed(numbered(parent, pattern)) if is_committed(path)), None)


@contextlib.contextmanager
def owned(path: str) -> Iterator[bool]:
    """Holds ``path``'s root lock (taken without waiting) through the with-block, so an earlier
    run's leftover there may be removed or published while a writer starting meanwhile is
    refused; yields False, holding nothing, when a live writer has it (logged)."""
    lock = RootLock(path)
    try:
        lock.acquire(0.0)
    except ZerostallError as exc:  # a live writer there (another job)
        log.warning("zerostall: leaving %s alone: %s", path, exc)
        yield False
        return
    try:
        yield True
    finally:
        lock.release()


def recover_staged(parent: str, staged: re.Pattern[str], final_parent: str | None = None, *,
                   publish: Callable[[str, str], bool] = lambda staged, final: False,
                   cut_short: Callable[[str], bool] = lambda name: False,
                   busy: Callable[[str], bool] = lambda final: False) -> None:
    """Start-up, the training thread of the one process that publishes: each save an earlier run
    left staged in ``parent`` (an entry ``staged`` matches; its group 1 names the checkpoint
    directory in ``final_parent``, default ``parent``, it was to become) that no live writer
    holds and is not ``busy(final)`` (this run's, in flight) is published there when
    ``publish(staged, final)`` (committed, the run stopped before renaming it), else removed;
    entries ``cut_short(name)`` (a discard a crash interrupted) are removed."""
    for n in names_in(parent):
        path = os.path.join(parent, n)
        if cut_short(n):
            discard(path)
            continue
        m = staged.match(n)
        final = None if m is None else os.path.join(final_parent or parent, m.group(1))
        if final is None or busy(final):
            continue
        with owned(path) as mine:
            if not mine:  # held: a live writer's (another job)
                continue
            if publish(path, final):
                log.info("zerostall: publishing %s as %s (committed; the run stopped before renaming it)",
                         path, final)
                publish_dir(path, final)
            else:
                log.info("zerostall: removing %s, a save of an earlier run that was not published", path)
                discard(path)


def next_step(ckpt: Checkpointer, wanted: int) -> int:
    """``wanted``, or one past the newest committed step when that is not larger (a path saved
    twice gets a new step; keep_last=1 then retires the old one after the commit)."""
    latest = max([*ckpt.inflight_steps(), *ckpt.steps()[-1:]], default=-1)  # a committed 0 counts
    return wanted if wanted > latest else latest + 1


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
    """While a save is being staged, make the framework's in-place updates wait for it: a
    global optimizer step pre-hook, and a global module forward pre-hook (only while a snapshot
    is in flight) that waits when the module about to run owns a buffer being copied (BatchNorm
    updates its statistics in forward). ``track`` after each ``save``; ``close`` removes the hooks.
    """

    def __init__(self) -> None:
        self._ckpts: list[Checkpointer] = []
        self._ptrs: set[int] = set()
        self._opt_hook: Any = None
        self._fwd_hook: Any = None

    def track(self, ckpt: Checkpointer, tensors: list[torch.Tensor]) -> None:
        self.forget_done()
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

    def _on_step(self, opt: Any, args: Any, kwargs: Any) -> Any:
        changed = None
        for c in list(self._ckpts):
            r = c.step_pre_hook(opt, args, kwargs)
            if r is not None:
                args, kwargs = changed = r
        return changed

    def _on_forward(self, module: torch.nn.Module, args: Any) -> None:
        if not any(c.snapshots_pending() for c in self._ckpts):
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
    """The tensors of a nested dict/list state, subclasses included (for the forward guard;
    torch's tree_leaves takes a dict subclass for a leaf)."""
    out: list[torch.Tensor] = []
    stack = [tree]
    while stack:
        x = stack.pop()
        if isinstance(x, torch.Tensor):
            out.append(x)
        elif isinstance(x, (dict, list, tuple)):
            stack.extend(x.values() if isinstance(x, dict) else x)
    return out


class Publisher:
    """Shows a staged checkpoint directory under the framework's name once it is committed (a
    framework's discovery lists names; one holding no committed step stops a resume): this
    thread waits for the save into ``staged``, closes its Checkpointer and renames ``staged``
    to ``final`` (``publish_dir``). A failed save's directory is removed; its error is kept.

    ``submit`` from the training thread; one pool thread publishes, in submission order (an
    interpreter exiting first still publishes what is queued: it joins that thread).
    ``_hook`` is the crash-test seam: called with ``"publish"`` just before each rename.
    """

    _hook: Callable[[str], None] | None = None

    def __init__(self, name: str = "zerostall-publish"):
        self._pool = ThreadPoolExecutor(1, thread_name_prefix=name)
        self._mu = threading.Lock()
        self._pending: Counter[str] = Counter()  # final -> saves queued for it
        self._errors: list[BaseException] = []

    def close(self) -> list[BaseException]:
        """Drain, stop the thread; the failures (failed saves, failed renames), oldest first."""
        self._pool.shutdown()  # handles everything queued first
        return self._errors

    def submit(self, staged: str, final: str, handle: Any, ckpt: Checkpointer, *,
               before: Callable[[], None] | None = None, after: Callable[[], None] | None = None,
               rename: bool = True) -> None:
        """Publish the save ``handle`` into ``staged`` (``ckpt``'s root, closed once the save is
        done) as ``final``; ``before`` runs just before the rename, ``after`` after it (e.g.
        retention); ``rename=False``: close only (a rank that does not own the directory)."""
        with self._mu:
            self._pending[final] += 1
        self._pool.submit(self._publish, staged, final, handle, ckpt, before, after, rename)

    def pending(self, final: str) -> bool:
        """Whether a save for ``final`` is still queued (not yet published or dropped)."""
        with self._mu:
            return self._pending[final] > 0

    def drain(self) -> None:
        """Block until everything submitted so far is published or dropped."""
        self._pool.submit(int).result()

    def _publish(self, staged: str, final: str, handle: Any, ckpt: Checkpointer,
                 before: Callable[[], None] | None, after: Callable[[], None] | None,
                 rename: bool) -> None:
        try:
            handle.wait()
            failed = handle.exception()
            try:
                ckpt.close()
            except ZerostallError as exc:
                failed = failed or exc
            if not rename:
                return
            if failed is not None:
                discard(staged)
                raise failed
            if before is not None:
                before()
            if self._hook is not None:
                self._hook("publish")
            publish_dir(staged, final, overwrite=True)
            if after is not None:
                after()
        except BaseException as exc:  # noqa: BLE001 - kept for close(), never lost in the thread
            log.error("zerostall: checkpoint %s was not published: %s", final, exc)
            with self._mu:
                self._errors.append(exc)
        finally:
            with self._mu:
                self._pending -= Counter((final,))  # drops the ones at 0


class AdapterSaves:
    """The saving side the adapters share (their training thread): the checkpointers' config
    (``keep_last=1``, never overwrite: a path saved twice gets a new step, :func:`next_step`),
    the :class:`StateGuard` and the :class:`Publisher` (started by the first save needing it)."""

    def __init__(self, config: CheckpointConfig | None, thread_name: str, **fields: Any) -> None:
        cfg = config if config is not None else CheckpointConfig.from_env()
        try:
            self.config = cfg.replace(**{**fields, "keep_last": 1, "overwrite": False})
        except TypeError as exc:
            raise ConfigError(f"unknown zerostall option: {exc}") from None
        self.guard = StateGuard()
        self.publisher: Publisher | None = None
        self._thread_name = thread_name

    def drain(self, final: str | None = None) -> None:
        """Block until every queued save (only when one of ``final`` is queued) is published."""
        pub = self.publisher
        if pub is not None and (final is None or pub.pending(final)):
            pub.drain()

    def publish(self, staged: str, final: str, handle: Any, ckpt: Checkpointer, **kwargs: Any) -> None:
        """Hand the save ``handle`` into ``staged`` to the publisher (:meth:`Publisher.submit`)."""
        self.publisher = self.publisher or Publisher(self._thread_name)
        self.publisher.submit(staged, final, handle, ckpt, **kwargs)

    def save(self, staged: str | Checkpointer, step: int, state: dict[str, Any],
             tensors: list[torch.Tensor]) -> tuple[Any, Any]:
        """(Checkpointer, SaveHandle) of a save of ``state`` into a new Checkpointer at
        ``staged`` (or into ``staged``, one opened with :attr:`config` already), at ``step`` or
        past the newest there; the guard holds ``tensors``'s in-place updates until the
        snapshot is staged."""
        ck = staged if isinstance(staged, Checkpointer) else Checkpointer(staged, self.config)
        try:
            handle = ck.save(next_step(ck, step), state)
        except BaseException:
            ck.close()
            raise
        self.guard.track(ck, tensors)
        return ck, handle

    def finish(self) -> list[BaseException]:
        """Block until every save is durable and published; the failures, oldest first."""
        self.guard.close()
        pub, self.publisher = self.publisher, None
        return [] if pub is None else pub.close()

    def wait(self) -> None:
        """:meth:`finish`, raising the first failure (the others are logged): the adapters'
        ``zerostall_wait``."""
        errors = self.finish()
        for exc in errors[1:]:
            log.error("zerostall: a checkpoint save failed: %s", exc)
        if errors:
            raise errors[0]
