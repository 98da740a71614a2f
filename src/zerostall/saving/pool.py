"""The process-wide staging pool: one arena, one block ring, one snapshot thread per process.

How the pool reserves, faults, grows and lingers: docs/design.md ("Memory: the staging pool").

Threads: ``lease``/``release`` from any thread; ``reserve`` and ``queue`` from the caller's
thread in ``save()``, under one lock, so the snapshot thread sees jobs in reservation order.
The pool knows nothing of Checkpointers: the snapshot thread hands each job on to the persist
worker the job names.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import os
import threading
from typing import Iterator

from ..memory.arena import Arena, ArenaView
from .job import Job, SaveStatus, Slot
from ..memory.ring import BlockRing
from .snapshot import Snapshotter

log = logging.getLogger("zerostall")

LINGER_S = 5.0
"""Seconds an unused pool stays mapped after its last user leaves."""
ONESHOT_RING_BYTES = 256 << 20
"""What a one-shot save asks of the pool: it streams through a ring this big."""


def want_bytes(file_bytes: int, block_bytes: int, slots: int, oneshot: bool) -> int:
    """What a user saving ``file_bytes`` asks of the pool: ``slots`` copies, or (one-shot
    saves) at most a ``ONESHOT_RING_BYTES`` ring to stream through."""
    blocks = -(-file_bytes // block_bytes) * block_bytes
    return min(blocks, ONESHOT_RING_BYTES) if oneshot else blocks * slots


RESERVE_MIN_BYTES = 1 << 30
"""Address space reserved at least (twice the ask, if more; never above the budget)."""
FIRST_LAP_BYTES = 64 << 20
"""The smallest ring a save gets while the pool is still being faulted (see ``ring_bytes``)."""


class Lease:
    """One user's claim on the pool: keeps it alive and states how much staging it wants,
    capped at the user's own ``budget_bytes``."""

    def __init__(self, pool: "StagingPool", want_bytes: int, budget_bytes: int | None = None):
        self.pool = pool
        self.budget_bytes = budget_bytes
        self.want_bytes = self._cap(want_bytes)
        self.released = False

    def _cap(self, nbytes: int) -> int:
        if self.budget_bytes is None:
            return nbytes
        budget = max(2 * self.pool.block_bytes, self.budget_bytes // self.pool.block_bytes * self.pool.block_bytes)
        return min(nbytes, budget)

    @property
    def ring(self) -> BlockRing:
        return self.pool.ring

    def want(self, nbytes: int) -> None:
        """Ask for at least ``nbytes`` of staging (grows the pool in the background)."""
        nbytes = self._cap(nbytes)
        with _lock:
            if nbytes > self.want_bytes:
                self.want_bytes = nbytes
                self.pool._retarget()

    def queue(self, job: Job) -> None:
        self.pool.queue(job)

    def release(self) -> None:
        if not self.released:
            self.released = True
            _release(self)


class StagingPool:
    """The staging memory and snapshot thread of one process. Use :func:`lease`."""

    def __init__(self, budget: int, block_bytes: int, *, mlock: bool, hugepages: bool, want: int = 0):
        self.budget = max(2 * block_bytes, budget // block_bytes * block_bytes)
        self.block_bytes = block_bytes
        self.key = (self.budget, block_bytes, mlock, hugepages)
        self._mlock, self._hugepages = mlock, hugepages
        self.arena = self._reserve(want)
        self.ring = BlockRing(2 * block_bytes, block_bytes)
        self.snap = Snapshotter(self.arena, self.ring)
        self.leases: list[Lease] = []
        self.lock = threading.Lock()
        self.target = 0
        self._swap_to = 0  # a target above the reservation: a new reservation at the next idle point

    def _reserve(self, want: int) -> Arena:
        """Address space for ``want`` bytes and room to grow (no RSS until faulted)."""
        size = min(self.budget, max(2 * want, RESERVE_MIN_BYTES))
        size = max(2 * self.block_bytes, -(-size // self.block_bytes) * self.block_bytes)
        arena = functools.partial(Arena, mlock=self._mlock, hugepages=self._hugepages, prefault=False,
                                  detached_views=True, dontfork=True)
        try:
            return arena(size)
        except OSError as exc:  # address space limited (ulimit -v): reserve only what is asked now
            fallback = max(2 * self.block_bytes, -(-want // self.block_bytes) * self.block_bytes)
            log.warning("zerostall: cannot reserve %d MiB of address space for staging (%s); reserving %d MiB",
                        size >> 20, exc, fallback >> 20)
            return arena(fallback)

    # -- any thread, under the module lock ---------------------------------------------------
    def _retarget(self) -> None:
        """Fault (in the background) what the largest live user wants, within the budget."""
        want = max((le.want_bytes for le in self.leases), default=0)
        if want == 0:
            return  # only joined so far (a Checkpointer before its first save)
        want = -(-want // self.block_bytes) * self.block_bytes
        target = max(2 * self.block_bytes, min(self.budget, want))
        if target <= self.target:
            return
        if want > self.budget:
            log.info("zerostall: staging wants %d MiB, above the %d MiB budget: snapshots stream "
                     "through a %d MiB ring", want >> 20, self.budget >> 20, target >> 20)
        with self.lock:
            self.target = target
            if target > self.arena.nbytes:
                self._swap_to = target
                self._swap_if_idle()
            else:
                self.arena.fault_to(target)
                self.ring.resize(self.ring_bytes())  # at once if idle, else at the next reservation

    def _swap_if_idle(self) -> None:
        """Replace the reservation by a larger one while no save uses it. Pool lock held."""
        if not self._swap_to or not self.ring.idle():
            return
        old, target, self._swap_to = self.arena, self._swap_to, 0
        new = self._reserve(target)
        if old.cuda_registered:
            new.register_cuda(old.cuda_device)  # chunks register as the faulter adds them
        self.arena = self.snap.arena = new
        old.close()  # idle: the snapshot thread and every persister are done with it
        new.fault_to(target)
        self.ring.resize(self.ring_bytes())

    def ring_bytes(self) -> int:
        """The ring a save reserved now gets: the target, or, while the faulter is still
        behind, the faulted prefix (at least ``FIRST_LAP_BYTES``): fresh memory can fault
        slower than the disk writes (docs/speed-tricks.md). Pool lock held."""
        B = self.block_bytes
        full = max(2 * B, min(self.target, self.arena.nbytes) // B * B)
        lap = max(2 * B, FIRST_LAP_BYTES // B * B, self.arena.ready // B * B)
        return min(full, lap)

    # -- caller's thread ----------------------------------------------------------------------
    @contextlib.contextmanager
    def reserve(self, nblocks: int, status: SaveStatus) -> Iterator[Slot]:
        """Reserve ``nblocks`` of the ring and hold the pool lock while the caller builds its
        job and calls :meth:`queue`. Blocks reserved but never queued (an exception, e.g. from
        a signal handler) are drained by the pool itself; ``status`` fails with it."""
        with self.lock:
            self._swap_if_idle()
            want = self.ring_bytes()
            if self.ring.capacity_bytes != want:
                self.ring.resize(want)
            g0 = self.ring.reserved
            slot = Slot(g0, nblocks, self.arena, self.ring.capacity_bytes)
            try:
                self.ring.reserve(nblocks)
            except BaseException as exc:  # interrupted after the ring moved: the blocks are this job's
                if self.ring.reserved != g0:
                    self._abandon(slot, status, exc)
                raise
            try:
                yield slot
            except BaseException as exc:
                if not status.queued:
                    self._abandon(slot, status, exc)
                raise

    def queue(self, job: Job) -> None:
        """Hand ``job`` to the snapshot thread (inside :meth:`reserve`). The mark and the put
        run with no Python frame between them (the put is the queue's C method, looked up
        first), so a signal handler sees the job either unqueued and unmarked or queued and
        marked: never marked and lost."""
        put = self.snap.enqueue
        job.status.mark_queued()
        put(job)

    def _abandon(self, slot: Slot, status: SaveStatus, exc: BaseException) -> None:
        """Blocks reserved that reached no worker: fail the save, let the snapshot thread
        publish the blocks unwritten (in ring order) and release them from a helper thread."""
        status.fail(exc, in_save=True)
        self.snap.submit(slot)  # publishes the blocks unwritten
        threading.Thread(target=drain, args=(self.ring, slot, slot.g0), daemon=True).start()

    @contextlib.contextmanager
    def borrow_idle(self) -> Iterator[ArenaView | None]:
        """The faulted arena as a scratch buffer, if no save uses it; saves wait meanwhile."""
        with self.lock:
            if self.ring.idle() and self.arena.ready >= 2 * self.block_bytes:
                yield self.arena.view(self.arena.ready)
            else:
                yield None

    def close(self) -> None:
        self.snap.stop()
        self.arena.close()


def drain(ring: BlockRing, slot: Slot, g: int) -> None:
    """Release ``slot``'s blocks from ``g`` on as the snapshot thread publishes them, unwritten
    (a failed or abandoned save; ranges: the persisters of several Checkpointers share the ring)."""
    while g < slot.g_end:
        hi = min(ring.wait_staged(g), slot.g_end)
        ring.release(g, hi)
        g = hi


_lock = threading.RLock()
_pool: StagingPool | None = None
_timer: threading.Timer | None = None


def current() -> StagingPool | None:
    """The live pool, if any (for tests and telemetry)."""
    return _pool


def lease(want_bytes: int, budget: int, block_bytes: int, *, mlock: bool = True,
          hugepages: bool = True) -> Lease:
    """Join the process's pool (creating it if needed) asking for ``want_bytes`` of staging. The
    first lease fixes its budget and block size; later ones with other values share it as it
    is while it has users, and replace it when not."""
    global _pool, _timer
    with _lock:
        if _timer is not None:
            _timer.cancel()
            _timer = None
        key = (max(2 * block_bytes, budget // block_bytes * block_bytes), block_bytes, mlock, hugepages)
        if _pool is not None and not _pool.leases and key != _pool.key:
            old, _pool = _pool, None  # unused, and configured otherwise: replace it
            old.close()
        if _pool is None:
            _pool = StagingPool(budget, block_bytes, mlock=mlock, hugepages=hugepages,
                                want=min(want_bytes, budget))
        elif key != _pool.key:
            log.debug("zerostall: staging pool already exists (budget %d, block %d); sharing it",
                      _pool.budget, _pool.block_bytes)
        le = Lease(_pool, want_bytes, budget)
        _pool.leases.append(le)
        _pool._retarget()
        return le


def _release(le: Lease) -> None:
    global _timer
    with _lock:
        pool = le.pool
        if le in pool.leases:
            pool.leases.remove(le)
        if pool.leases or pool is not _pool:
            return
        if LINGER_S <= 0:
            _close_if_unused(pool)
            return
        _timer = threading.Timer(LINGER_S, _close_if_unused, args=(pool,))
        _timer.daemon = True
        _timer.start()


def _close_if_unused(pool: StagingPool) -> None:
    global _pool
    with _lock:
        if pool.leases or pool is not _pool:
            return
        _pool = None
    pool.close()


def _after_fork_in_child() -> None:
    """A forked child has none of the pool's threads: forget the parent's pool (its memory is
    the parent's copy-on-write image) so the child's first Checkpointer builds its own."""
    global _lock, _pool, _timer
    _lock = threading.RLock()
    _pool = None
    _timer = None


os.register_at_fork(after_in_child=_after_fork_in_child)


def release_now() -> None:
    """Free an unused pool at once instead of after the linger (tests, shutdown)."""
    global _timer
    with _lock:
        if _timer is not None:
            _timer.cancel()
            _timer = None
        pool = _pool
    if pool is not None:
        _close_if_unused(pool)


