"""The persist thread: writes staged blocks to the shard file, then commits.

One daemon thread owned by the ``Checkpointer``. For each job, in order: create
``step-N.partial/`` and the shard file (O_DIRECT, preallocated), write blocks as the
snapshot thread publishes them (in batches, so the engine keeps its queue full), release
each block back to the ring once written, ``fdatasync``, then run the local tier's commit
and retention. On any error before the commit point the job fails, its remaining blocks are
drained unwritten (so the ring keeps moving and later saves proceed), and its partial
directory is removed; the previous checkpoint is never touched. After the commit point (the
rename) nothing fails the job: a ``latest`` hint or retention failure is logged and recorded
in ``job.post_commit_errors`` (``SaveRecord.post_commit_errors``); the handle is durable.
"""

from __future__ import annotations

import collections
import logging
import mmap
import os
import time
from typing import Any, Callable

from .._util import Worker
from ..errors import CheckpointExistsError
from ..format.layout import HEADER_BYTES
from ..format.manifest import FileEntry, Manifest, TensorEntry
from ..format.shard import CrcCursor
from ..io.base import Engine, ShardFile
from ..staging.arena import Arena
from ..staging.incremental import RefTracker, manifest_parts
from ..staging.job import SaveJob
from ..staging.ring import BlockRing
from .local import LocalTier
from .retention import dependents, newest_commits

log = logging.getLogger("zerostall")


def file_entry(job: SaveJob) -> FileEntry:
    """The manifest's entry of this rank's shard; ``host`` is the node (``ZEROSTALL_NODE``)."""
    from ..distributed.node import node_id  # here: distributed/ sits above store/ and imports it
    return FileEntry(job.file_name, job.rank, node_id(), job.plan.file_bytes, job.checkpoint_id)


def tensor_entries(job: SaveJob) -> list[tuple[int, TensorEntry]]:
    """(global tensor index, entry) for every tensor this rank wrote."""
    return [(it.index, TensorEntry(it.key, it.dtype, it.shape, job.file_name, it.offset, it.nbytes, crc))
            for it, crc in zip(job.plan.items, job.crcs)]


def build_manifest(job: SaveJob) -> Manifest:
    """The manifest of a single-rank save (with its references, for an incremental one)."""
    tensors, ref_files = manifest_parts(job, tensor_entries(job))
    return Manifest(step=job.step, world_size=job.world_size, checkpoint_id=job.checkpoint_id,
                    created_unix=time.time(), files=(file_entry(job),),
                    tensors=tensors, tree=job.plan.tree, tree_json=job.plan.tree_json,
                    user_metadata=dict(job.user_metadata), ref_files=ref_files)


class LocalCommitter:
    """Commit strategy of a single rank: write the manifest and rename (see :mod:`.local`)."""

    def __init__(self, tier: LocalTier):
        self.tier = tier

    def begin(self, job: SaveJob) -> str:
        return self.tier.begin(job.step)

    def commit(self, job: SaveJob) -> tuple[str, ...]:
        return self.tier.commit(job.step, build_manifest(job), overwrite=job.overwrite, latest=False)

    def after_durable(self, job: SaveJob) -> tuple[str, ...]:
        """The ``latest`` hint, once the handle says durable (two fsyncs off that path)."""
        return self.tier.write_latest(job.step)

    def fail(self, job: SaveJob, exc: BaseException) -> None:
        self.tier.abort(job.step)


def retain_at_start(tier: LocalTier, keep_last: int, protect: set[int] = frozenset()) -> list[int]:  # type: ignore[assignment]
    """Start-up retention by a root's new owner (``Checkpointer`` construction, caller's thread,
    right after ``LocalTier.own()`` and before any save; local tier, no remote).

    A kill between a commit and its retention leaves a step beyond ``keep_last``; without
    this, each such kill in a row would add one more. Same invariants as after a commit
    (:mod:`.retention`): validated steps only, never the newest, never ``protect`` nor the
    steps committed last (:func:`~.retention.newest_commits`), references spared, newest first.
    A failure is logged, never raised (nothing is lost by keeping a step).

    Returns the ``keep_last`` steps committed last, oldest first: the Persister keeps
    protecting them as this writer's own newest commits.
    """
    recent = newest_commits(tier.steps(), tier.read_manifest, keep_last)
    try:
        tier.apply_retention(keep_last, protect=set(recent) | set(protect))
    except Exception as exc:  # noqa: BLE001 - an extra step on disk is not worth refusing to start
        log.warning("zerostall: start-up retention (keep_last=%d) in %s failed: %s", keep_last, tier.root, exc)
    return recent


class Persister(Worker[SaveJob]):
    def __init__(self, tier: LocalTier, engine: Engine, arena: Arena, ring: BlockRing, *,
                 keep_last: int | None, on_done: Callable[[SaveJob], None], committer: Any = None,
                 refs: RefTracker | None = None, recent: list[int] = []):  # noqa: B006 - never mutated
        self.tier = tier
        self.refs = refs
        self.committer = committer or LocalCommitter(tier)
        self.engine = engine
        self.arena = arena
        self.ring = ring
        self.keep_last = keep_last
        self._recent: collections.deque[int] = collections.deque(recent, maxlen=keep_last or 1)
        """This writer's newest committed steps, oldest first, seeded with the root's last commits
        (``recent``, from :func:`retain_at_start`): retention never deletes them (see store/retention.py)."""
        self.on_done = on_done
        self._hdr: mmap.mmap | None = None
        super().__init__("zerostall-persist")

    # -- persist thread -------------------------------------------------------------------
    def _check_not_referenced(self, job: SaveJob) -> None:
        """An overwrite commits only if no step borrows the old bytes (persist thread, just
        before the commit: ``save()`` checked too, but an incremental save queued before it
        may have referenced the step since)."""
        if not os.path.isdir(self.tier.step_dir(job.step)):
            return
        users = dependents(self.tier.steps(), job.step, self.tier.read_manifest)
        if users or job.step in self.refs.pinned_steps():
            raise CheckpointExistsError(
                f"step {job.step} in {self.tier.root!r} cannot be overwritten: steps {users or 'being saved'} "
                "reference its bytes (incremental saves); nothing committed, pick another step")

    def _retain(self, job: SaveJob) -> None:
        """Retention after ``job`` committed; a failure is recorded on the job, never raised."""
        self._recent.append(job.step)
        if self.keep_last is None:
            return
        try:
            protect = set(self._recent) | (self.refs.protected() if self.refs is not None else set())
            self.tier.apply_retention(self.keep_last, protect=protect, just_committed=job.step)
        except Exception as exc:  # noqa: BLE001 - nothing after the commit point fails the save
            msg = f"retention after step {job.step} failed: {exc}"
            log.warning("zerostall: %s", msg)
            job.post_commit_errors.append(msg)

    @property
    def batch_blocks(self) -> int:
        return max(1, min(self.ring.nblocks // 2, 64))  # the shared ring may grow

    def _extents(self, job: SaveJob, g: int, hi: int, file_bytes: int | None = None) -> list[tuple[int, memoryview]]:
        B, n = self.ring.block_bytes, self.ring.nblocks
        file_bytes = job.plan.file_bytes if file_bytes is None else file_bytes
        mv = (job.arena or self.arena).mv  # the pool may have swapped arenas since this Persister began
        out = []
        while g < hi:
            run_end = min(hi, (g // n + 1) * n)  # split where the ring wraps
            foff = (g - job.g0) * B
            length = min((run_end - g) * B, file_bytes - foff)
            aoff = self.ring.slot_offset(g)
            out.append((foff, mv[aoff:aoff + length]))
            g = run_end
        return out

    def _write_blocks(self, job: SaveJob, f: ShardFile, g: int, file_bytes: int, crc: CrcCursor) -> int:
        """Write the job's blocks from ``g`` up to ``file_bytes`` as the snapshot thread
        publishes them, checksumming while the writes are in flight; returns the next block."""
        g_file = min(job.g_end, job.g0 + self.ring.blocks_for(file_bytes))
        while g < g_file:
            hi = min(self.ring.wait_staged(g), g_file, g + self.batch_blocks)
            if job.error is not None:
                raise job.error
            extents = self._extents(job, g, hi, file_bytes)
            f.write(extents, overlap=lambda: crc.feed(extents))
            self.ring.release(g, hi)
            g = hi
        return g

    def _header_block(self, job: SaveJob) -> memoryview:
        """The job's header, zero-padded to HEADER_BYTES, in an aligned buffer (O_DIRECT)."""
        if self._hdr is None:
            self._hdr = mmap.mmap(-1, HEADER_BYTES)  # page-aligned; kept (an engine may still reference it)
        raw = job.header.encode()
        self._hdr[:] = raw + bytes(HEADER_BYTES - len(raw))
        return memoryview(self._hdr)

    def _drain(self, job: SaveJob, g: int) -> None:
        while g < job.g_end:
            hi = min(self.ring.wait_staged(g), job.g_end)
            self.ring.release(g, hi)  # ranges: persisters of several Checkpointers share the ring
            g = hi

    def handle(self, job: SaveJob) -> None:
        job.engine = self.engine.name
        g = job.g0
        f: ShardFile | None = None
        t0 = time.perf_counter()
        try:
            part = self.committer.begin(job)
            job.layout_ready.wait()  # an incremental save's plan is final only now (smaller)
            if job.error is not None:
                raise job.error
            # an incremental save may append to job.plan until staged (RefTracker.settle): the
            # file starts as the layout announced by layout_ready
            plan = job.incr.layout if job.incr is not None and job.incr.layout is not None else job.plan
            f = self.engine.open_write(os.path.join(part, job.file_name), plan.file_bytes)
            crc = CrcCursor(plan.items)
            g = self._write_blocks(job, f, g, plan.file_bytes, crc)
            if job.incr is not None:  # not staged: the appended blocks may need the ring's slots
                job.incr.settled.wait()
            if job.error is not None:
                raise job.error
            crcs = crc.crcs
            ext = job.incr.extension if job.incr is not None else None
            if ext is not None:  # tensors that changed behind their version counter, appended
                ext_crc = CrcCursor(ext[1])
                g = self._write_blocks(job, f, g, job.plan.file_bytes, ext_crc)
                crcs = crcs + ext_crc.crcs
            job.staged.wait()
            if job.error is not None:
                raise job.error
            if ext is not None:
                f.write([(0, self._header_block(job))])  # the header names the final size
            self.ring.release(g, job.g_end)  # blocks reserved for tensors an incremental save referenced
            g = job.g_end
            job.crcs = crcs
            f.finish()
            f.close()
            f = None
            t1 = time.perf_counter()
            job.persist_s = t1 - t0
            if self.refs is not None:
                self.refs.before_commit(job, self.tier.root)
                if job.overwrite:
                    self._check_not_referenced(job)
            post = self.committer.commit(job)  # the commit point: from here on the step exists
            if self.refs is not None and job.incr is not None:  # before retention: the new base
                self.refs.committed(job, file_entry(job), tensor_entries(job))
            job.commit_s = time.perf_counter() - t1
            job.t_durable = time.perf_counter()
            job.post_commit_errors.extend(post or ())
            job.durable.set()
            after = getattr(self.committer, "after_durable", None)
            if after is not None:
                job.post_commit_errors.extend(after(job))
            self._retain(job)
        except BaseException as exc:  # noqa: BLE001 - reported on the handle
            job.fail(exc)
            if self.refs is not None and not job.durable.is_set():
                self.refs.failed(job)
            self._drain(job, g)
            if f is not None:
                try:
                    f.close()
                except OSError:
                    pass
            try:
                self.committer.fail(job, exc)
            except Exception as cexc:  # noqa: BLE001 - the original error is the one to report
                log.error("zerostall: cleaning up step %d failed: %s", job.step, cexc)
            log.error("zerostall: save of step %d failed, nothing committed: %s", job.step, exc)
        finally:
            try:
                self.on_done(job)  # records and telemetry are final before anyone sees done
            except Exception:  # noqa: BLE001 - a sink failing must not wedge the pipeline
                log.exception("zerostall: recording step %d failed", job.step)
            job.done.set()
