"""How a rank's persist thread commits a step: the :class:`Committer` protocol and the
single-rank :class:`LocalCommitter` (the multi-rank one is :class:`.commit_ranks.StoreCommitter`).

Called on the persist thread, once per save, in this order: ``begin`` (before the shard is
opened), then either ``commit`` (the shard is written and fdatasynced; the commit point) and
``after_durable`` (the handle already says durable), or ``fail`` (any error before the commit
point: clean up, tell the other ranks). ``report`` runs on the caller's thread for a save that
failed in ``save()`` before it was queued (never blocks). ``fail`` may also run on the
caller's thread for a skipped save.
"""

from __future__ import annotations

import time
from typing import Protocol, Sequence

from ..format.manifest import Entries, FileEntry, Manifest, TensorEntry, tensors_json
from ..format.table import new_entry
from ..format.refs import RefFile
from .job import Persisted, SaveRequest
from ..store.local import LocalTier
from ..distributed.node import node_id


class Committer(Protocol):
    def begin(self, job: SaveRequest) -> str:
        """Make the step's partial directory; returns its path."""
        ...

    def commit(self, job: Persisted) -> Sequence[str] | None:
        """Commit the step (raise: nothing committed); returns problems after the commit point."""
        ...

    def after_durable(self, job: Persisted) -> Sequence[str]:
        """Work after the handle says durable (the ``latest`` hint); returns problems."""
        ...

    def fail(self, job: SaveRequest, exc: BaseException) -> None:
        """The save failed before the commit point: remove what it wrote, tell the others."""
        ...

    def report(self, step: int, exc: BaseException) -> None:
        """A save of ``step`` failed on this rank before it was queued (caller's thread)."""
        ...


def file_entry(job: Persisted) -> FileEntry:
    """The manifest's entry of this rank's shard; ``host`` is the node (``ZEROSTALL_NODE``)."""
    return FileEntry(job.file_name, job.rank, node_id(), job.plan.file_bytes, job.checkpoint_id)


def tensor_entries(job: Persisted) -> list[tuple[int, TensorEntry]]:
    """(global tensor index, entry) for every tensor this rank wrote."""
    name = job.file_name  # once: a property that formats the name
    return [(it.index, new_entry(key=it.key, dtype=it.dtype, shape=it.shape, file=name, offset=it.offset,
                                 nbytes=it.nbytes, crc32c=crc)) for it, crc in zip(job.plan.items, job.crcs)]


def merged_entries(job: Persisted, written: list[tuple[int, TensorEntry]]) -> tuple[list[tuple[int, TensorEntry]],
                                                                                   tuple[RefFile, ...]]:
    """(global tensor index, entry) for every tensor of this rank, written and referenced, in
    index order, and the files the references live in (a multi-rank save's fragment)."""
    ij = job.incr  # an IncrementalJob (.incremental), or None
    if ij is None or not ij.refs:
        return list(written), ()
    return sorted({**dict(written), **ij.refs}.items()), ij.ref_files


def build_manifest(job: Persisted) -> Manifest:
    """The manifest of a single-rank save (with its references, for an incremental one)."""
    if job.incr is None or not job.incr.refs:  # written only: entries made on access
        tensors, ref_files = Entries(job.plan.items, job.file_name, job.crcs), ()
    else:
        entries, ref_files = merged_entries(job, tensor_entries(job))
        tensors = tuple(e for _, e in entries)
    tree, tree_json = job.plan.final()  # frozen Python objects encoded (if the snapshot thread has not yet)
    return Manifest(step=job.step, world_size=job.world_size, checkpoint_id=job.checkpoint_id,
                    created_unix=time.time(), files=(file_entry(job),),
                    tensors=tensors, tree=tree, tree_json=tree_json,
                    tensors_json="" if ref_files else tensors_json(tensors, job.plan.memo),
                    user_metadata=dict(job.user_metadata), ref_files=ref_files)


class LocalCommitter:
    """Commit strategy of a single rank: write the manifest and rename (see :mod:`.local`)."""

    def __init__(self, tier: LocalTier):
        self.tier = tier

    def begin(self, job: SaveRequest) -> str:
        return self.tier.begin(job.step)

    def commit(self, job: Persisted) -> Sequence[str] | None:
        return self.tier.commit(job.step, build_manifest(job), overwrite=job.overwrite, latest=False)

    def after_durable(self, job: Persisted) -> Sequence[str]:
        """The ``latest`` hint, once the handle says durable (two fsyncs off that path)."""
        return self.tier.write_latest(job.step)

    def fail(self, job: SaveRequest, exc: BaseException) -> None:
        self.tier.abort(job.step)

    def report(self, step: int, exc: BaseException) -> None:
        """Nobody else to tell."""
