"""The persist thread: writes staged blocks to the shard file, then commits.

One daemon thread per ``Checkpointer``; jobs arrive from the snapshot thread, in order. For
each job: ``Committer.begin``, wait for the layout (``Job.layout``), create the shard file
(O_DIRECT, preallocated), write blocks as the snapshot thread publishes them (in batches),
release each block back to the ring once written, ``fdatasync``, then hand a
:class:`~.job.Persisted` record to the committer. On any error before the commit point the
save fails, its remaining blocks are drained unwritten (so the ring keeps moving), and
``Committer.fail`` removes its partial directory; the previous checkpoint is never touched.

After the commit point (``SaveStatus.claim_commit``, then the rename) nothing fails the save:
it is marked durable and a :class:`~.job.Committed` record goes to each subscriber in order
(:meth:`Persister._after_commit`). Last, ``finished(job)`` builds the save's record. Nothing
here calls back into the ``Checkpointer``.

Local retention leaves a doomed step's files (``LocalTier.deferred``) for the next full save to
write over (``spare_shard``, docs/every-step.md); this thread removes what is left (``chores``).
"""

from __future__ import annotations

import contextlib
import logging
import mmap
import os
import time
import weakref
from typing import Any, Callable, Protocol

from .._util import Worker
from ..format.layout import HEADER_BYTES
from ..format.shard import CrcCursor
from ..io.base import Engine, ShardFile
from .incremental import RefTracker
from .job import Committed, Forward, Job, Persisted
from .plan import SavePlan
from .pool import drain
from ..memory.ring import BlockRing
from .commit import Committer, LocalCommitter, file_entry, tensor_entries
from ..store.local import LocalTier
from ..store.retention import check_not_referenced

log = logging.getLogger("zerostall")


class CommitSubscriber(Protocol):
    """A stage after the commit point (persist thread, in commit order; keep it short: hand
    the record to your own thread). What it raises is logged and recorded on the save, which
    stays durable."""

    def on_committed(self, record: Committed) -> None: ...


class Persister(Worker[Job]):
    def __init__(self, tier: LocalTier, engine: Engine, ring: BlockRing, *, finished: Callable[[Job], None],
                 upstream: Any, committer: Committer | None = None, refs: RefTracker | None = None):
        self.tier = tier
        self.upstream = upstream
        """The snapshot worker that hands this one its jobs: ``stop`` travels through it, so
        every job queued before a stop still reaches this thread first."""
        self.refs = refs
        self.committer: Committer = committer or LocalCommitter(tier)
        self.engine = engine
        self.ring = ring
        self.finished = finished
        self._subscribers: list[CommitSubscriber] = []
        self._hdr: mmap.mmap | None = None
        self._pinned: Callable[[], Any] = lambda: None  # the arena registered with the engine (weak)
        super().__init__("zerostall-persist")

    def _put_last(self, item: Any) -> None:
        self.upstream.submit(Forward(self, item))

    def on_exit(self) -> None:
        self.tier.deferred.run()

    def subscribe(self, subscriber: CommitSubscriber) -> None:
        """Hand every step this persist thread commits to ``subscriber.on_committed`` (caller's
        thread, before the first save)."""
        self._subscribers.append(subscriber)

    # -- persist thread -------------------------------------------------------------------
    def _extents(self, job: Job, g: int, hi: int, file_bytes: int) -> list[tuple[int, memoryview]]:
        B, n = self.ring.block_bytes, self.ring.nblocks
        g0, mv = job.slot.g0, job.slot.arena.mv  # the pool may have swapped arenas since this Persister began
        out = []
        while g < hi:
            run_end = min(hi, (g // n + 1) * n)  # split where the ring wraps
            foff = (g - g0) * B
            length = min((run_end - g) * B, file_bytes - foff)
            aoff = self.ring.slot_offset(g)
            out.append((foff, mv[aoff:aoff + length]))
            g = run_end
        return out

    def _write_blocks(self, job: Job, f: ShardFile, g: int, file_bytes: int, crc: CrcCursor | None,
                      chores: Callable[[], None] | None = None) -> int:
        """Write the job's blocks from ``g`` up to ``file_bytes`` as they are published,
        checksumming while the writes are in flight (``crc``; None: checksummed at copy) and
        running ``chores`` (once, never raising) while the first ones are; returns the next block."""
        g_file = min(job.slot.g_end, job.slot.g0 + self.ring.blocks_for(file_bytes))
        while g < g_file:
            hi = min(self.ring.wait_staged(g), g_file, g + max(1, min(self.ring.nblocks // 2, 64)))
            _raise_if_failed(job)
            extents = self._extents(job, g, hi, file_bytes)

            def overlap(extents: Any = extents, chores: Any = chores) -> None:  # while the writes are in flight
                if chores is not None:
                    chores()
                if crc is not None:
                    crc.feed(extents)
            f.write(extents, overlap=overlap)
            chores = None
            self.ring.release(g, hi)
            g = hi
        return g

    def _header_block(self, job: Job, plan: SavePlan) -> memoryview:
        """The job's header, zero-padded to HEADER_BYTES, in an aligned buffer (O_DIRECT)."""
        if self._hdr is None:
            self._hdr = mmap.mmap(-1, HEADER_BYTES)  # page-aligned; kept (an engine may still reference it)
        raw = job.header(plan).encode()
        self._hdr[:] = raw + bytes(HEADER_BYTES - len(raw))
        return memoryview(self._hdr)

    def _rewrite(self, path: str, file_bytes: int) -> ShardFile | None:
        """The doomed shard moved to ``path``, opened to write ``file_bytes`` over it; None (the
        file removed) when that fails: the caller writes a new file, a save never fails for a spare."""
        try:
            growth = file_bytes - os.path.getsize(path)
            if growth > 0:  # the file grows: that allocates too
                self.tier.deferred.run_if_short(growth)
            return self.engine.open_rewrite(path, file_bytes)
        except OSError as exc:  # StorageError included
            log.info("zerostall: writing a new %s, not over the old shard: %s", path, exc)
            os.unlink(path)
            return None

    def _write(self, job: Job, part: str) -> tuple[Persisted, int]:
        """Write and fdatasync the shard; returns the record for the committer and the next block."""
        t0 = time.perf_counter()
        g = job.slot.g0
        layout = job.layout.get()  # an incremental save's plan is final only now (smaller)
        _raise_if_failed(job)
        arena, ring_bytes = job.slot.arena, self.ring.capacity_bytes
        if getattr(arena, "ready", 0) >= ring_bytes:  # once faulted (registering would fault it, here and now)
            # another arena (the pool swapped them) may sit where the registered one was: register anew
            fresh = arena is not self._pinned()
            self.engine.pin_buffer(arena.address, ring_bytes, fresh=fresh)
            if fresh:
                self._pinned = weakref.ref(arena)
        deferred, path = self.tier.deferred, os.path.join(part, job.request.file_name)
        # a full save writes every byte of its file: it may write over a doomed step's shard
        f: ShardFile | None = None
        if job.incr is None and deferred and deferred.take(job.request.file_name, path):
            f = self._rewrite(path, layout.file_bytes)
        if f is None:
            deferred.run_if_short(layout.file_bytes)
            f = self.engine.open_write(path, layout.file_bytes)
        try:
            crc = None if job.crc_at_copy else CrcCursor(layout.items)
            g = self._write_blocks(job, f, g, layout.file_bytes, crc, deferred.run if deferred else None)
            crcs = crc.crcs if crc is not None else []
            # not staged yet: the appended blocks may need the ring's slots (RefTracker.settle)
            ext = job.extension.get()
            _raise_if_failed(job)
            if ext is not None:  # tensors that changed behind their version counter, appended
                ext_crc = CrcCursor(ext.items[len(layout.items):])
                g = self._write_blocks(job, f, g, ext.file_bytes, ext_crc)
                crcs = crcs + ext_crc.crcs
            at_copy = job.snapshot.get()
            _raise_if_failed(job)
            plan = layout if ext is None else ext
            if crc is None:  # checksummed at copy time (never with an extension: a full save)
                if at_copy is None or len(at_copy) != len(plan.items):
                    raise RuntimeError(f"step {job.step}: the snapshot gave no crc32c of its tensors")
                crcs = list(at_copy)
            if ext is not None:
                f.write([(0, self._header_block(job, ext))])  # the header names the final size
            self.ring.release(g, job.slot.g_end)  # blocks reserved for tensors an incremental save referenced
            g = job.slot.g_end
            f.finish()
        except BaseException:
            with contextlib.suppress(OSError):
                f.close()
            raise
        f.close()
        return Persisted(job.request, plan, tuple(crcs), job.incr, time.perf_counter() - t0), g

    def handle(self, job: Job) -> None:
        req, status = job.request, job.status
        g = job.slot.g0
        try:
            part = self.committer.begin(req)
            persisted, g = self._write(job, part)
            t1 = time.perf_counter()
            if self.refs is not None:
                self.refs.before_commit(persisted, self.tier.root)
                if req.overwrite:  # save() checked too, but a save queued before may reference it since
                    check_not_referenced(self.tier, req.step, self.refs.pinned_steps(), queued=True)
            if not status.claim_commit():  # failed meanwhile (close() inside save())
                raise status.error or RuntimeError("failed")
            post = self.committer.commit(persisted)  # the commit point: from here on the step exists
        except BaseException as exc:  # noqa: BLE001 - reported on the handle
            if not status.fail(exc):  # after claim_commit: this thread's own error
                status.commit_failed(exc)
            if self.refs is not None and job.incr is not None and not status.durable.is_set():
                self.refs.failed(job.incr)
            drain(self.ring, job.slot, g)
            try:
                self.committer.fail(req, exc)
            except Exception as cexc:  # noqa: BLE001 - the original error is the one to report
                log.error("zerostall: cleaning up step %d failed: %s", req.step, cexc)
            log.error("zerostall: save of step %d failed: %s", req.step, exc)  # the error says what is committed
        else:
            self._after_commit(job, persisted, post, t1)
        finally:
            if self.tier.deferred and self.idle():  # else while the next save's writes are in flight
                self.tier.deferred.run(keep=req.file_name)  # the next save writes over the spare
            status.mark_post_commit()
            try:
                self.finished(job)  # records and telemetry are final before anyone sees done
            except Exception:  # noqa: BLE001 - a sink failing must not wedge the pipeline
                log.exception("zerostall: recording step %d failed", req.step)
            status.done.set()  # last: after the record is built

    def _after_commit(self, job: Job, persisted: Persisted, post: Any, t1: float) -> None:
        """Past the commit point nothing fails the save, whatever it raises (``SystemExit``
        from a subscriber's hook included): each problem is noted on the save, which stays
        durable, and every subscriber still sees the step."""
        req, status = job.request, job.status
        if self.refs is not None and job.incr is not None:  # before retention: the new base
            refs = self.refs
            if not _noted(status, "incremental base", job.step, lambda: refs.committed(
                    persisted, file_entry(persisted), tensor_entries(persisted))):
                refs.failed(job.incr)  # the base stays the previous one; unpinned
        status.note(*(post or ()))
        status.mark_durable(persisted.persist_s, time.perf_counter() - t1)
        _noted(status, "the latest hint", job.step, lambda: status.note(*self.committer.after_durable(persisted)))
        record = Committed(req.step, req.checkpoint_id, req.overwrite, req.rank, status)
        for sub in self._subscribers:
            _noted(status, getattr(sub, "name", type(sub).__name__), job.step, lambda sub=sub: sub.on_committed(record))


def _noted(status: Any, what: str, step: int, fn: Callable[[], None]) -> bool:
    """Run ``fn`` after the commit point; what it raises is logged and noted on the save."""
    try:
        fn()
        return True
    except BaseException as exc:  # noqa: BLE001 - nothing after the commit point fails the save
        msg = f"{what} after step {step} failed: {str(exc) or repr(exc)}"
        log.warning("zerostall: %s", msg)
        status.note(msg)
        return False


def _raise_if_failed(job: Job) -> None:
    if job.status.error is not None:
        raise job.status.error
