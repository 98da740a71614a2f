"""How a rank's persist thread commits a step: the :class:`Committer` protocol, the single-rank
:class:`LocalCommitter` and the multi-rank :class:`StoreCommitter` (the round of
:mod:`..distributed.commit`).

Called on the persist thread, once per save, in this order: ``begin`` (before the shard is
opened), then either ``commit`` (the shard is written and fdatasynced; the commit point) and
``after_durable`` (the handle already says durable), or ``fail`` (any error before the commit
point: clean up, tell the other ranks). ``report`` runs on the caller's thread for a save that
failed in ``save()`` before it was queued (never blocks past a bounded store request). ``fail``
may also run on the caller's thread for a skipped save. ``StoreCommitter.drain`` runs on the
caller's thread in ``Checkpointer.close()``.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import time
from typing import Any, Protocol, Sequence

from ..format.manifest import Entries, FileEntry, Manifest, TensorEntry, tensors_json
from ..format.table import new_entry
from ..format.refs import RefFile
from .incremental import RefTracker
from .job import Persisted, SaveRequest
from ..store.recovery import DECIDED_NAME
from ..store.local import LocalTier
from ..distributed.commit import (OutcomeUnknown, commit_round, fault_point, grace_s, post_begin, report_failure,
                                  step_base, wait_acked)
from ..distributed.agree import agree_room
from ..distributed.node import node_id
from ..distributed.session import Session
from ..distributed.store import Store


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


class StoreCommitter:
    """The commit strategy of several ranks saving together: a round of :mod:`..distributed.commit`."""

    def __init__(self, tier: LocalTier, store: Store, session: Session, *, per_rank: bool, timeout_s: float):
        self.tier, self.store, self.session = tier, store, session
        self.rank, self.world = session.rank, session.world
        self.per_rank, self.timeout_s = per_rank, timeout_s
        self.node_local, self.leaders = session.node_local, session.leaders
        self.refs: RefTracker | None = None
        """Set by the Checkpointer for incremental saves (before the first save)."""
        self._committed: list[int] = []  # rank 0: rounds whose acknowledgements close() waits for
        self._reported: set[int] = set()  # steps whose round this rank entered (persist thread)
        self._began: dict[int, float] = {}  # step -> when the persist thread picked it up (persist thread)
        self._room_seq = 0  # skip-mode saves agreed so far (caller's thread)

    def begin(self, job: SaveRequest) -> str:
        self._reported.discard(job.step)  # a new save of the step (overwrite)
        # the round's deadline counts a rank that began the step late (busy with an earlier one) from then
        self._began[job.step] = post_begin(self.store, self.session, job.step)
        for s in [s for s in self._began if s != job.step][:-8]:
            del self._began[s]
        fault_point("persist", self.session, job.step)
        d = self.tier.partial_dir(job.step)
        os.makedirs(d, exist_ok=True)
        own = os.path.join(d, job.file_name)
        if os.path.lexists(own):  # left by an earlier, failed attempt of this rank
            os.unlink(own)
        rec = os.path.join(d, DECIDED_NAME)
        if self.session.is_leader and os.path.lexists(rec):  # an earlier round's record: not this one's
            os.unlink(rec)
        return d

    def fragment(self, job: Persisted) -> dict[str, Any]:
        tree = job.plan.final()[0]  # frozen Python objects encoded (if the snapshot thread has not yet)
        tree_json = json.dumps(tree, sort_keys=True)
        entries, ref_files = merged_entries(job, tensor_entries(job))  # written and referenced
        if self.per_rank:
            structure = json.dumps([[it.key, it.dtype, list(it.shape)] for it in job.plan.items], sort_keys=True)
        else:  # keys, dtypes and shapes of every tensor of the state, not only those this rank writes
            structure = hashlib.sha256((tree_json + job.request.plan.shapes_digest).encode()).hexdigest()
        out = {"ok": True, "file": file_entry(job).__dict__, "n_tensors": job.plan.n_tensors,
               "tensors": [[g, e.to_json()] for g, e in entries], "tree": tree, "structure": structure}
        if ref_files:
            out["ref_files"] = [r.to_json() for r in ref_files]
        if self.refs is not None:
            out["protect"] = sorted(self.refs.protected(own=True))
        return out

    def commit(self, job: Persisted) -> tuple[str, ...]:
        fragment = self.fragment(job)  # may raise (a frozen object's encoding): fail() then tells the others
        self._reported.add(job.step)
        post = commit_round(self.store, self.session, fragment, self.tier, job.step,
                            per_rank=self.per_rank, timeout_s=self.timeout_s, overwrite=job.overwrite,
                            user_metadata=dict(job.user_metadata),
                            protect=self.refs.set_peer_protected if self.refs is not None else None,
                            began=self._began.pop(job.step, None))
        if self.rank == 0:
            self._committed.append(job.step)
            del self._committed[:-64]
        return post

    def after_durable(self, job: Persisted) -> tuple[str, ...]:
        return ()  # the copy's leader wrote the ``latest`` hint in the round

    def agree_room(self, step: int, room: bool) -> bool | None:
        """``backpressure="skip"``: whether every rank has staging room for this save (caller's
        thread, in ``save()``, every rank in the same order); None when a rank reported ``step``
        failed or did not answer within the commit timeout (:func:`~zerostall.distributed.agree.agree_room`)."""
        self._room_seq += 1
        return agree_room(self.store, self.session, self._room_seq, room, self.timeout_s,
                          abort=f"{step_base(self.session, step)}/decision")

    def pass_room(self) -> None:
        """This rank's ``save()`` failed before its room agreement (it reported the step failed,
        which aborts the others' wait): keep the agreements' count in step with theirs."""
        self._room_seq += 1

    def report(self, step: int, exc: BaseException) -> None:
        """A save of ``step`` failed on this rank before a job was queued (caller's thread)."""
        report_failure(self.store, self.session, step, exc)

    def fail(self, job: SaveRequest, exc: BaseException) -> None:
        decided = True
        if job.step not in self._reported:  # its round ran: the others know; else tell them now
            self._reported.add(job.step)
            dec = report_failure(self.store, self.session, job.step, exc)
            decided = dec is not None and not dec.get("commit")
        if not decided or isinstance(exc, OutcomeUnknown):
            return  # the coordinator may still commit this step: delete nothing of it
        if self.session.is_leader:
            self.tier.abort(job.step)
        else:
            with contextlib.suppress(OSError):
                os.unlink(os.path.join(self.tier.partial_dir(job.step), job.file_name))

    def drain(self) -> list[int]:
        """Rank 0 at close(): wait (bounded) until every rank read the decisions of the rounds it
        committed, so a store hosted in this process outlives their reads. Returns the open ones."""
        if self.rank != 0 or not self._committed:
            return []
        open_ = wait_acked(self.store, self.session, self._committed, grace_s(self.timeout_s) * 2)
        self._committed.clear()
        return open_

    def close(self) -> None:
        self.store.close()
