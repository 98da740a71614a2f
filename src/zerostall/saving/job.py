"""The records of one save: one per pipeline stage, each written by one thread and handed forward.

::

    caller (save())        SaveRequest   frozen: step, plan, rank, overwrite, metadata, id
    staging pool (caller)  Slot          frozen: the save's blocks of the shared ring
    caller -> snapshot     Source        the tensors; owned by the snapshot thread once queued
    snapshot -> persist    Handoff ``layout``, ``extension`` (RefTracker.settle), ``snapshot``
    persist -> committer   Persisted     frozen: the final plan, every tensor's crc32c
    persist -> subscribers Committed     frozen: what retention, replication, peer replicas need

:class:`SaveStatus` is the one object more than one thread touches, changed only through its
methods (each names its thread) and read lock-free. :class:`Job` is the frozen envelope that
travels the queues (caller -> snapshot thread -> the job's persist thread).
"""

from __future__ import annotations

import threading
import time
import uuid
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any, Generic, Mapping, TypeVar

import torch

from ..format.layout import ShardHeader, shard_name
from .plan import SavePlan

T = TypeVar("T")
_COMMIT = object()  # SaveStatus' commit claim


@dataclass(frozen=True, kw_only=True)
class SaveRequest:
    """What ``save()`` asked for (caller's thread); never changed. ``plan`` is the plan of
    the whole state: an incremental save writes a smaller one (``Job.layout``)."""

    step: int
    plan: SavePlan
    rank: int = 0
    world_size: int = 1
    overwrite: bool = False
    user_metadata: Mapping[str, Any] = field(default_factory=lambda: MappingProxyType({}))
    checkpoint_id: str = field(default_factory=lambda: uuid.uuid4().hex)
    engine: str = ""

    @property
    def file_name(self) -> str:
        return shard_name(self.rank)


@dataclass(frozen=True)
class Slot:
    """Blocks ``g0 .. g_end`` of the shared ring and the arena they live in (the pool may swap
    arenas between saves). Made by the staging pool under its lock on the caller's thread."""

    g0: int
    nblocks: int
    arena: Any
    arena_bytes: int = 0

    @property
    def g_end(self) -> int:
        return self.g0 + self.nblocks


@dataclass(frozen=True)
class Persisted:
    """The shard is written and fdatasynced (persist thread -> committer): what a manifest,
    or a multi-rank fragment, is made of."""

    request: SaveRequest
    plan: SavePlan
    crcs: tuple[int, ...]
    incr: Any = None
    """The incremental part (:class:`.incremental.IncrementalJob`), read-only by now."""
    persist_s: float = 0.0

    step = property(lambda self: self.request.step)
    rank = property(lambda self: self.request.rank)
    world_size = property(lambda self: self.request.world_size)
    overwrite = property(lambda self: self.request.overwrite)
    user_metadata = property(lambda self: self.request.user_metadata)
    checkpoint_id = property(lambda self: self.request.checkpoint_id)
    file_name = property(lambda self: self.request.file_name)


@dataclass(frozen=True)
class Committed:
    """A step committed by this rank's persist thread, handed to the post-commit subscribers
    (``on_committed``, persist thread, in commit order). ``status`` is there for the stages
    that report later through it (replication: :meth:`SaveStatus.mark_replicated`)."""

    step: int
    checkpoint_id: str
    overwrite: bool
    rank: int
    status: "SaveStatus"


@dataclass(frozen=True)
class Forward:
    """Not a save: ``item`` for the end of ``worker``'s queue, sent through the snapshot thread
    so that it arrives after every job queued before it (a persist worker's stop)."""

    worker: Any
    item: Any


class Handoff(Generic[T]):
    """A value put once by one thread and read by another (which may wait for it)."""

    def __init__(self) -> None:
        self._ev = threading.Event()
        self._value: Any = None

    def put(self, value: T) -> None:
        if not self._ev.is_set():
            self._value = value
            self._ev.set()

    def get(self, timeout: float | None = None) -> T:
        self._ev.wait(timeout)
        return self._value

    def ready(self) -> bool:
        return self._ev.is_set()


@dataclass(eq=False)
class Source:
    """The caller's tensors and CUDA events of one save; owned by the snapshot thread once
    queued, which drops the tensors when staged."""

    leaves: list[torch.Tensor] | None
    cuda_event: Any = None
    """CUDA: ``{device index: event}`` recorded on each device's current stream at ``save()``."""
    _reads: set[int] | None = field(default=None, init=False, repr=False)

    def reads(self, storages: set[int], staged: threading.Event) -> bool:
        """Whether the snapshot may still read one of ``storages`` (storage addresses)."""
        leaves = self.leaves  # dropped by the snapshot thread once every byte is copied
        if leaves is None or staged.is_set():
            return False
        if self._reads is None:
            self._reads = {t.untyped_storage().data_ptr() for t in leaves}
        return not self._reads.isdisjoint(storages)


class SaveStatus:
    """Events, error and timings of one save. Events and the error change only through these
    methods, each from the thread it names; a plain field is assigned by the one thread that owns
    it (``save_block_s``, ``interval_steps``: caller; ``telemetry``: persist; ``replicate_error``:
    replicator). Reads are lock-free (signal handlers poll the events)."""

    def __init__(self, t_submit: float | None = None, nbytes: int = 0):
        self.t_submit = time.perf_counter() if t_submit is None else t_submit
        self.queued = False
        """Set just before the job's one queue put (no Python frame in between, see ``pool.queue``)."""
        self.staged = threading.Event()
        self.durable = threading.Event()
        self.done = threading.Event()
        self.replicated = threading.Event()
        self.error: BaseException | None = None
        self.error_in_save = False
        """The error was raised from ``save()`` itself (not to re-raise as a background error)."""
        self.replicate_error: BaseException | None = None
        self.skipped = False
        self.interval_steps = 0
        """Steps since the previous save that was not skipped (0 for the first)."""
        self.nbytes = nbytes
        self.save_block_s = self.guard_wait_s = self.snapshot_s = self.persist_s = self.commit_s = 0.0
        self.post_commit_s = 0.0
        self.t_staged = self.t_durable = 0.0
        self.post_commit_errors: list[str] = []
        """Problems after the commit point (latest hint, retention): logged, the save stays durable."""
        self.telemetry: dict[str, Any] = {}
        self._claims: list[Any] = []
        self._wait_lock = threading.Lock()

    # -- any thread -------------------------------------------------------------------------
    def fail(self, exc: BaseException, *, in_save: bool = False) -> bool:
        """Fail the save unless it failed already or its commit began (then False). Lock-free
        (``list.append`` is atomic): safe from a signal handler."""
        self._claims.append(exc)
        first = self._claims[0]
        if first is _COMMIT:
            return False
        if first is exc:
            self.error, self.error_in_save = exc, in_save
        return True

    def add_guard_wait(self, seconds: float) -> None:
        """A caller waited ``seconds`` for this snapshot (counted as stall)."""
        with self._wait_lock:
            self.guard_wait_s += seconds

    # -- caller's thread --------------------------------------------------------------------
    def mark_queued(self) -> None:
        """The staging pool is queueing the job (a plain store: no Python frame runs after it)."""
        self.queued = True

    def skip(self, seconds: float) -> None:
        """``backpressure="skip"``: nothing is written; every event is set."""
        self.skipped, self.save_block_s, self.nbytes = True, seconds, 0
        for e in (self.staged, self.durable, self.done):
            e.set()

    # -- snapshot thread --------------------------------------------------------------------
    def mark_staged(self, snapshot_s: float, nbytes: int) -> None:
        self.snapshot_s, self.nbytes = snapshot_s, nbytes
        self.t_staged = time.perf_counter()
        self.staged.set()

    # -- persist thread ---------------------------------------------------------------------
    def claim_commit(self) -> bool:
        """Just before the commit point: from now on :meth:`fail` from other threads is
        refused. False (and nothing may be committed) if the save failed first."""
        self._claims.append(_COMMIT)
        return self._claims[0] is _COMMIT

    def commit_failed(self, exc: BaseException) -> None:
        """The commit itself failed after :meth:`claim_commit` (the persist thread's own error)."""
        if self.error is None:
            self.error = exc

    def mark_durable(self, persist_s: float, commit_s: float) -> None:
        self.persist_s, self.commit_s = persist_s, commit_s
        self.t_durable = time.perf_counter()
        self.durable.set()

    def mark_post_commit(self) -> None:
        """The persist thread is done with this durable save (hints, subscribers, removals)."""
        if self.t_durable:
            self.post_commit_s = time.perf_counter() - self.t_durable

    def note(self, *problems: str) -> None:
        """Problems after the commit point; the save stays durable."""
        self.post_commit_errors.extend(problems)

    # -- replicator thread (or close() on the caller's) ---------------------------------------
    def mark_replicated(self, error: BaseException | None = None) -> None:
        self.replicate_error = error
        self.replicated.set()


@dataclass(frozen=True, eq=False)
class Job:
    """One save in flight: the envelope the queues carry. Frozen; what changes lives in
    ``status``, ``source`` (the snapshot thread's) and the handoffs (each put once)."""

    request: SaveRequest
    status: SaveStatus
    slot: Slot
    source: Source = field(default_factory=lambda: Source(None))
    incr: Any = None
    """The incremental part (:class:`.incremental.IncrementalJob`), or None for a full save."""
    persist: Any = None
    """The persist worker (``submit(job)``) the snapshot thread hands the job to; None for a
    slot the pool drains itself."""
    crc_at_copy: bool = False
    """The snapshot thread checksums each tensor as it copies it (:data:`.snapshot.CRC_AT_COPY`)."""
    layout: Handoff[SavePlan] = field(default_factory=Handoff)
    extension: Handoff[SavePlan | None] = field(default_factory=Handoff)
    snapshot: Handoff[tuple[int, ...] | None] = field(default_factory=Handoff)
    """Put when the snapshot is over: every item's crc32c, taken as it was copied
    (``crc_at_copy``); else None."""

    @property
    def step(self) -> int:
        return self.request.step

    def header(self, plan: SavePlan) -> ShardHeader:
        r = self.request
        return ShardHeader(r.checkpoint_id, r.step, r.rank, plan.file_bytes)

