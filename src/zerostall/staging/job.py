"""One save in flight: the record every pipeline stage reads and fills in.

Created by the caller's thread in ``Checkpointer.save()``; the snapshot thread fills
``crcs`` and sets ``staged``; the persist thread sets ``durable`` (or ``error``) and
``done``. Times are ``time.perf_counter()`` seconds.
"""

from __future__ import annotations

import threading
import time
import uuid
from dataclasses import dataclass, field
from typing import Any

import torch

from ..format.layout import ShardHeader, shard_name
from .plan import SavePlan


def _set_event() -> threading.Event:
    e = threading.Event()
    e.set()
    return e


@dataclass(eq=False)
class SaveJob:
    step: int
    plan: SavePlan
    seq: int = 0
    rank: int = 0
    world_size: int = 1
    g0: int = 0
    nblocks: int = 0
    overwrite: bool = False
    user_metadata: dict[str, Any] = field(default_factory=dict)
    checkpoint_id: str = field(default_factory=lambda: uuid.uuid4().hex)
    crcs: list[int] = field(default_factory=list)
    leaves: list[torch.Tensor] | None = None
    cuda_event: Any = None
    """CUDA: ``{device index: event}`` recorded on each device's current stream at ``save()``."""
    arena: Any = None
    """The staging arena this job's blocks live in (set when reserved; the pool may swap later)."""
    reserved: bool = False
    """Set by the staging pool once blocks ``g0 .. g_end`` of the shared ring are this job's."""
    pool_drained: bool = False
    """Set by the pool when it drained this job's blocks itself (it reserved, then reached no worker)."""
    staged: threading.Event = field(default_factory=threading.Event)
    durable: threading.Event = field(default_factory=threading.Event)
    done: threading.Event = field(default_factory=threading.Event)
    replicated: threading.Event = field(default_factory=threading.Event)
    replicate_error: BaseException | None = None
    t_replicated: float = 0.0
    error: BaseException | None = None
    post_commit_errors: list[str] = field(default_factory=list)
    """Problems after the commit point (latest hint, retention): logged, the save stays durable."""
    skipped: bool = False
    reported: bool = False
    """Set by the committer once this rank's outcome of the step was sent to the other ranks."""
    to_persist: bool = False
    to_snap: bool = False
    submitted: bool = False
    """Set by ``Checkpointer.save()`` once both pipeline threads have the job."""
    raised_in_save: bool = False
    """Its error was raised from ``save()`` itself (not re-raised as a background error)."""
    _reads: set[int] | None = None
    t_submit: float = field(default_factory=time.perf_counter)
    t_staged: float = 0.0
    t_durable: float = 0.0
    save_block_s: float = 0.0
    guard_wait_s: float = 0.0
    snapshot_s: float = 0.0
    persist_s: float = 0.0
    commit_s: float = 0.0
    engine: str = ""
    arena_bytes: int = 0
    telemetry: dict[str, Any] = field(default_factory=dict)
    incr: Any = None
    """The incremental part (:class:`.incremental.IncrementalJob`), or None for a full save."""
    layout_ready: threading.Event = field(default_factory=_set_event)
    """Cleared for incremental saves until the snapshot thread has fixed ``plan`` (it may shrink
    it); the persist thread reads ``plan`` only after this is set."""

    @property
    def header(self) -> ShardHeader:
        return ShardHeader(self.checkpoint_id, self.step, self.rank, self.plan.file_bytes)

    @property
    def g_end(self) -> int:
        return self.g0 + self.nblocks

    @property
    def file_name(self) -> str:
        return shard_name(self.rank)

    def reads(self, storages: set[int]) -> bool:
        """Whether the snapshot may still read one of ``storages`` (storage addresses).

        Called by the optimizer guard on the caller's thread; False once staged.
        """
        leaves = self.leaves  # the snapshot thread drops it once every byte is copied
        if leaves is None or self.staged.is_set():
            return False
        if self._reads is None:
            self._reads = {t.untyped_storage().data_ptr() for t in leaves}
        return not self._reads.isdisjoint(storages)

    def fail(self, exc: BaseException) -> None:
        if self.error is None:
            self.error = exc
