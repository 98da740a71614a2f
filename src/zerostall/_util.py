"""Small shared pieces: the background-worker pattern and lazy ``"module:attr"`` targets.

The bottom of the import graph: imports nothing from zerostall.
"""

from __future__ import annotations

import contextlib
import gc
import importlib
import os
import queue
import resource
import threading
from typing import Any, Callable, Generic, Iterator, TypeVar

T = TypeVar("T")


class _Last:
    def __init__(self, fn: Callable[[], None]):
        self.fn = fn


def human_bytes(n: float) -> str:
    """``1536`` -> ``"1.5 KiB"`` (the CLI's and the status hints' byte counts)."""
    i = 0
    while abs(n) >= 1024 and i < 4:
        n, i = n / 1024, i + 1
    return f"{n:.1f} {('B', 'KiB', 'MiB', 'GiB', 'TiB')[i]}" if i else f"{int(n)} B"


def load_target(target: str) -> Any:
    """``"package.module:attr"`` -> the attribute (raises ImportError/AttributeError)."""
    mod, _, attr = target.partition(":")
    return getattr(importlib.import_module(mod), attr)


LOCAL_RANK_VARS = ("LOCAL_RANK", "SLURM_LOCALID", "OMPI_COMM_WORLD_LOCAL_RANK", "MPI_LOCALRANKID")
"""Where launchers put a process's rank on its node (torchrun/Lightning/Accelerate, Slurm, Open MPI, MPICH)."""


def node_leader() -> bool:
    """Whether this process should print node-wide warnings (RLIMIT_MEMLOCK, host settings):
    local rank 0 (the first of :data:`LOCAL_RANK_VARS` that is set), or a process launched
    without one."""
    for var in LOCAL_RANK_VARS:
        v = os.environ.get(var, "").strip()
        if v:
            return v == "0"
    return True


def swap_total_bytes() -> int:
    """The node's swap space: whether an unlocked arena can be paged out."""
    import psutil  # here: ``import zerostall`` does not load it

    return psutil.swap_memory().total


def memlock_fix(nbytes: int, hard: int) -> str:
    """The one command that lets this node lock ``nbytes`` (for the staging arena's message)."""
    if hard == resource.RLIM_INFINITY or hard >= nbytes:
        return "run 'ulimit -l unlimited' in the shell that launches training"
    return ("as root, 'echo \"* - memlock unlimited\" > /etc/security/limits.d/90-zerostall.conf' and log in "
            "again (systemd: LimitMEMLOCK=infinity; docker: --ulimit memlock=-1)")


class Worker(Generic[T]):
    """One daemon thread draining a FIFO of items with ``handle(item)``, in order. ``submit``
    may be called from any thread; ``stop`` processes what is queued, then joins."""

    def __init__(self, name: str):
        self._q: queue.SimpleQueue[T | None] = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._loop, name=name, daemon=True)
        self._thread.start()

    def submit(self, item: T) -> None:
        self._q.put(item)

    @property
    def enqueue(self) -> Callable[[T], None]:
        """The queue's own (C) ``put``: calling it runs no Python frame (see ``pool.queue``)."""
        return self._q.put

    def stop(self, timeout: float | None = None) -> bool:
        """Finish what is queued and join; False if the thread is still busy after ``timeout``
        (it keeps running as a daemon). Takes no lock without a timeout: signal-handler safe."""
        self._put_last(None)
        self._thread.join(timeout)
        return not self._thread.is_alive()

    def stop_then(self, fn: Callable[[], None]) -> None:
        """Finish what is queued, run ``fn`` in the worker thread, and exit; returns at once
        (for a finalizer, which must not block the thread that happens to collect)."""
        self._put_last(_Last(fn))

    def _put_last(self, item: Any) -> None:
        """Queue the end of the work (a worker fed by another one sends it the same way)."""
        self._q.put(item)

    def _loop(self) -> None:
        while True:
            item = self._q.get()
            if item is None:
                self.on_exit()
                return
            if isinstance(item, _Last):
                self.on_exit()
                item.fn()
                return
            self.handle(item)

    def idle(self) -> bool:
        """Nothing is queued behind the item being handled (worker thread; a hint: an item
        may arrive right after)."""
        return self._q.empty()

    def on_exit(self) -> None:
        """Runs last, in the worker thread, once every queued item is handled (before a
        ``stop_then`` function)."""

    def handle(self, item: T) -> None:
        raise NotImplementedError


def run_in_fresh_thread(fn: Callable[[], None], name: str) -> None:
    """Run ``fn`` in a new thread that then exits, re-raising its exception here (for torch
    ops that must not leave per-thread state, e.g. a CUDA "last error" or an OpenMP team). A
    plain thread: an executor refuses work once the interpreter exits (the atexit drain)."""
    err: list[BaseException] = []

    def run() -> None:
        try:
            fn()
        except BaseException as exc:  # noqa: BLE001 - re-raised in the caller
            err.append(exc)

    t = threading.Thread(target=run, name=name)
    t.start()
    t.join()
    if err:
        raise err[0]


_GC_LOCK = threading.Lock()
_GC_PAUSED = [0, False]  # [threads inside no_gc, whether the GC was enabled before the first]


@contextlib.contextmanager
def no_gc() -> Iterator[None]:
    """Pause the cyclic GC while building many acyclic objects (a save plan, a manifest parse:
    objects per tensor that would trigger gen-2 collections of the whole heap). The counts carry
    over, so a collection due runs afterwards. A GC the caller disabled stays disabled; threads
    pausing at once re-enable it when the last one is done."""
    with _GC_LOCK:
        if _GC_PAUSED[0] == 0:
            _GC_PAUSED[1] = gc.isenabled()
            gc.disable()
        _GC_PAUSED[0] += 1
    try:
        yield
    finally:
        with _GC_LOCK:
            _GC_PAUSED[0] -= 1
            if _GC_PAUSED[0] == 0 and _GC_PAUSED[1]:
                gc.enable()
