"""Incremental saves: a tensor unchanged since the last committed step is referenced, not rewritten.

Who calls what, from which thread (one :class:`RefTracker` per ``Checkpointer``):

1. caller's thread, ``save()``: :meth:`RefTracker.prepare` records each tensor's
   *fingerprint* (torch's version counter, data pointer, shape, strides, dtype, device) — a
   few attribute reads per tensor, no data is touched. The plan keeps room for every tensor
   (the ring reserves the worst case).
2. snapshot thread, first thing for the job: :meth:`RefTracker.decide` compares each tensor
   with what the newest committed step recorded under the same key and shrinks the plan to
   the tensors that must be written; the persist thread waits for this plan
   (``Job.layout``) before it creates the file, and releases the ring blocks the
   smaller file does not use. Whether a tensor may be referenced (the two modes, ``"crc"``
   and ``"version"``, and what each can miss) is :mod:`.content_check`'s to say.
3. persist thread: :meth:`before_commit` checks every referenced file is still there;
   :meth:`committed` (after the commit, before retention) makes this step the new base and
   unpins what the job referenced; :meth:`failed` unpins.
4. any thread running retention: :meth:`protected` — steps that a save in flight or the
   next save may reference (they must not be deleted even before a manifest names them).

References are flattened: an entry points at the step that wrote the bytes, never at a
step that itself references them (``full_every``: docs/incremental.md).
"""

from __future__ import annotations

import collections
import logging
import os
import threading
from dataclasses import dataclass, field
from typing import Any, Callable

import torch

from ..errors import StorageError
from ..format.manifest import FileEntry, Manifest, TensorEntry
from ..format.refs import RefFile
from ..format.decode import tensor_paths
from .job import Persisted, SaveRequest
from .plan import PlanItem, SavePlan, repack
from . import content_check
from .content_check import ContentCheck, Stamp, base_file_problem, file_stamp
from .source_crc import CRC_THREADS, _CpuCrc, _CudaCrc

log = logging.getLogger("zerostall")


def mode_of(incremental: bool | str) -> str | None:
    """``CheckpointConfig.incremental`` (validated there) -> ``"crc"``, ``"version"`` or None (off)."""
    return "crc" if incremental is True else incremental or None  # type: ignore[return-value]


def fingerprint(t: torch.Tensor, is_numpy: bool = False) -> tuple[Any, ...] | None:
    """What must not change for a tensor to be "unchanged" by the fast path; None if unknown."""
    if is_numpy:
        return None  # a fresh torch view of the array each save: its version counter says nothing
    try:
        version = t._version
    except RuntimeError:  # inference tensors have no version counter
        return None
    return (version, t.data_ptr(), tuple(t.shape), tuple(t.stride()), t.dtype, str(t.device))


@dataclass(frozen=True)
class Known:
    """What the newest committed step holds at one tree path (:func:`..format.decode.tensor_paths`)."""

    entry: TensorEntry  # step set: the step (and file) that wrote the bytes
    ref: RefFile
    fp: tuple[Any, ...] | None
    dh: int | None = None  # CUDA tensors: :func:`.source_crc.device_hash_async` of these bytes, if computed


@dataclass
class IncrementalJob:
    """The incremental part of one save; owned by the snapshot thread until ``layout_ready``,
    read-only afterwards."""

    tracker: "RefTracker"
    fps: dict[int, tuple[Any, ...] | None]  # tensor index -> fingerprint at save() time
    paths: dict[int, str] = field(default_factory=dict)
    """Tensor index -> its typed tree path (:func:`..format.decode.tensor_paths`): the identity
    under which the base is looked up and this save is recorded; never the printed key, which
    two different paths can share (``"a.b"`` and ``a`` -> ``b``, ``0`` and ``"0"``)."""
    refs: dict[int, TensorEntry] = field(default_factory=dict)  # global tensor index -> reference
    ref_files: tuple[RefFile, ...] = ()
    pinned: tuple[int, ...] = ()
    full: bool = True
    crc_bytes: int = 0  # bytes checksummed from the source on the host (CPU tensors; CUDA via a bounce buffer)
    dev_hash_bytes: int = 0  # CUDA bytes checked by their device hash (nothing copied to the host)
    dhs: dict[int, int] = field(default_factory=dict)  # tensor index -> device hash computed by this save
    pending: Any = None  # (collect crcs, [(item, leaf, tensor, recorded crc32c)]): referenced on speculation

    @property
    def bytes_referenced(self) -> int:
        return sum(e.nbytes for e in self.refs.values())


class RefTracker(ContentCheck):
    def __init__(self, mode: str, full_every: int | None):
        """``mode`` and ``full_every`` as :class:`~zerostall.config.CheckpointConfig` validated them."""
        self.mode = mode
        self.full_every = full_every
        self._lock = threading.Lock()
        self._known: dict[str, Known] = {}  # by tree path; replaced, never mutated: readers keep a snapshot
        self._paths: tuple[Any, dict[int, str]] = (None, {})  # (tree, its tensor paths), kept for the next save
        self._pins: collections.Counter[int] = collections.Counter()
        self._since_full = 0  # incremental decisions since the last full one (snapshot thread)
        self._force_full = False
        self._cuda_crc = _CudaCrc()  # its pinned buffer made at first use
        self._cpu_crc = _CpuCrc(CRC_THREADS)  # its threads started at first use
        self._seed_root: str | None = None
        self._seeded = False  # the base came from disk, not from a save of this process
        self._peer: set[int] = set()  # other ranks' protected steps (multi-rank; set_peer_protected)
        self._lost_warned: set[int] = set()  # base steps found gone or damaged (warned once each)
        self._stamps: dict[tuple[int, str], Stamp] = {}  # base files as they were (content_check.file_stamp)
        self._dh_warned = False

    # -- start-up (caller's thread) --------------------------------------------------------
    def seed_from(self, steps: list[int], read_manifest: Callable[[int], Manifest], root: str | None = None, *,
                  rank: int = 0, world_size: int = 1) -> None:
        """Make the newest committed step of the root the base (if its manifest reads): its
        tensors have no fingerprint, so the first save checks each by crc; and its files may
        have been damaged since: with ``root``, that save crc-checks every file span it would
        reference (:meth:`_verify_on_disk`) and writes the tensor instead of a mismatch. Only
        ``rank``'s own files count: a rank references nothing but bytes it wrote (keys repeat
        across ranks)."""
        self._seed_root = root
        if not steps:
            return
        try:
            man = read_manifest(steps[-1])
        except Exception as exc:  # noqa: BLE001 - no base: the first save is full
            log.info("zerostall: incremental: no base from step %d (%s); the first save is full", steps[-1], exc)
            return
        if man.world_size != world_size:
            log.info("zerostall: incremental: step %d was saved by %d rank(s), this is %d; the first save is full",
                     man.step, man.world_size, world_size)
            return
        files = {f.name: RefFile(man.step, f.name, f.rank, f.file_bytes, f.file_id or man.checkpoint_id)
                 for f in man.files}
        refs = {(r.step, r.name): r for r in man.ref_files}
        known = {}
        paths = tensor_paths(man.tree_for(rank, man.world_size))
        for i, e in enumerate(man.tensors):
            if i not in paths:  # another rank's tensor (per-rank trees)
                continue
            if e.step is None:
                ref = files[e.file]
                e = TensorEntry(e.key, e.dtype, e.shape, e.file, e.offset, e.nbytes, e.crc32c, man.step)
            else:
                ref = refs[(e.step, e.file)]
            if ref.rank == rank:
                known[paths[i]] = Known(e, ref, None)
        stamps = self._stamps_of(known, {})
        oldest = min((r.step for r in man.ref_files), default=man.step)
        with self._lock:
            self._known, self._stamps, self._seeded = known, stamps, root is not None
            self._since_full = sum(1 for s in steps if s > oldest)

    # -- caller's thread --------------------------------------------------------------------
    def prepare(self, plan: SavePlan) -> "IncrementalJob":
        """The incremental part of a save of ``plan``: the fingerprints only."""
        return IncrementalJob(self, {it.index: fingerprint(leaf.tensor, leaf.numpy)
                                     for it, leaf in zip(plan.items, plan.leaves)})

    def pinned_steps(self) -> set[int]:
        with self._lock:
            return set(self._pins)

    # -- snapshot thread --------------------------------------------------------------------
    def decide(self, req: SaveRequest, plan: SavePlan, leaves: list[torch.Tensor],
               cuda_run: Callable[[torch.device, Callable[[], None]], None],
               ij: "IncrementalJob") -> tuple[SavePlan, list[torch.Tensor]]:
        """Choose what to reference; return the plan and tensors to write."""
        if self._paths[0] is not plan.tree:  # the plan cache hands the same tree back while the state keeps its shape
            self._paths = (plan.tree, tensor_paths(plan.tree))
        ij.paths = self._paths[1]
        with self._lock:
            known = self._known
            full = (not known or self._force_full or
                    (self.full_every is not None and self._since_full + 1 >= self.full_every))
            self._force_full = False
            self._since_full = 0 if full else self._since_full + 1
        if not full:  # a base lost whole: nothing is referenced, a full save
            known = self._usable(known, req.step)
        ij.full = full
        leaves = list(leaves)
        if self.mode == "crc" and any(content_check._on_device(t) for t in leaves):  # full saves too: the next compares
            self._device_hashes(plan.items, leaves, cuda_run, ij)
        if full:
            return plan, leaves
        keep: list[tuple[PlanItem, Any, torch.Tensor]] = []  # (item, its plan leaf, its tensor)
        refs: dict[int, TensorEntry] = {}
        ref_files: dict[tuple[int, str], RefFile] = {}
        verdict: list[bool | None] = []  # True: reference; False: write; None: decided by the crc
        paths = ij.paths
        for item, leaf in zip(plan.items, leaves):
            k = known.get(paths[item.index])
            verdict.append(False if k is None else self._fast_path(item, ij.fps.get(item.index), k, req.step))
        if not self._speculate(plan, leaves, known, verdict, ij):
            self._confirm(plan.items, leaves, known, verdict, cuda_run, ij)
        if self._seeded:
            self._verify_on_disk(plan.items, known, verdict, paths)
        for item, lf, leaf, ok in zip(plan.items, plan.leaves, leaves, verdict):
            if ok:
                k = known[paths[item.index]]
                e = k.entry
                refs[item.index] = TensorEntry(item.key, e.dtype, e.shape, e.file, e.offset, e.nbytes,
                                               e.crc32c, e.step)
                ref_files[(k.ref.step, k.ref.name)] = k.ref
            else:
                keep.append((item, lf, leaf))
        with self._lock:  # pin before anyone can see the smaller plan
            steps = tuple(sorted({s for s, _ in ref_files}))
            self._pins.update(steps)
            if not refs:
                self._since_full = 0  # nothing referenced: this is a full save
        ij.refs, ij.ref_files, ij.pinned = refs, tuple(ref_files.values()), steps
        ij.full = not refs
        return repack(plan, [row[0] for row in keep], [row[1] for row in keep]), [row[2] for row in keep]

    def _usable(self, known: dict[str, Known], step: int) -> dict[str, Known]:
        """``known`` less what lives in a base file that is gone or no longer the file it was
        (:func:`.content_check.base_file_problem`): those tensors are written by this save
        instead of referenced, and each lost base step is reported once (snapshot thread)."""
        if self._seed_root is None:
            return known
        files = {(k.ref.step, k.ref.name): k.ref for k in known.values()}
        lost = {where: why for where, ref in files.items()
                if (why := base_file_problem(self._seed_root, ref, self._stamps.get(where))) is not None}
        if not lost:
            return known
        for (s, name), why in sorted(lost.items()):
            if s not in self._lost_warned:
                self._lost_warned.add(s)
                n = sum(1 for k in known.values() if (k.ref.step, k.ref.name) == (s, name))
                log.warning("zerostall: incremental: base step %d is gone or damaged (%s: %s); step %d writes "
                            "the %d tensor(s) it would have referenced there", s, name, why, step, n)
        return {p: k for p, k in known.items() if (k.ref.step, k.ref.name) not in lost}

    # -- persist thread -----------------------------------------------------------------------
    def before_commit(self, job: Persisted, root: str) -> None:
        """Every referenced file is still the file that was written (:func:`.content_check.base_file_problem`)."""
        for r in job.incr.ref_files if job.incr is not None else ():
            why = base_file_problem(root, r)
            if why is not None:
                path = os.path.join(root, f"step-{r.step}", r.name)
                raise StorageError(f"{path}: referenced by step {job.step}, but no longer the file it was ({why}); "
                                   "nothing committed", filename=path)

    def committed(self, job: Persisted, file: FileEntry, written: list[tuple[int, TensorEntry]]) -> None:
        """``job`` is committed: its tensors (written or referenced) are the new base."""
        ij: IncrementalJob = job.incr
        own = RefFile(job.step, file.name, file.rank, file.file_bytes, file.file_id or job.checkpoint_id)
        refs_by = {(r.step, r.name): r for r in ij.ref_files}
        fps, dhs, paths = ij.fps, ij.dhs, ij.paths
        known: dict[str, Known] = {}
        for i, e in written:
            known[paths[i]] = Known(TensorEntry(e.key, e.dtype, e.shape, e.file, e.offset, e.nbytes, e.crc32c,
                                                job.step), own, fps.get(i), dhs.get(i))
        for i, e in ij.refs.items():
            known[paths[i]] = Known(e, refs_by[(e.step, e.file)], fps.get(i), dhs.get(i))
        stamps = self._stamps_of(known, self._stamps)  # this step's own file: stamped now
        with self._lock:  # not seeded: every reference of the new base was checked or written here
            self._known, self._stamps, self._seeded = known, stamps, False
            self._unpin(ij)

    def _stamps_of(self, known: dict[str, Known], old: dict[tuple[int, str], Stamp]) -> dict[tuple[int, str], Stamp]:
        """The stamp of every file ``known`` borrows from: kept from ``old`` (taken when that
        file became a base), else taken now (a file just committed, or a base read from disk)."""
        out: dict[tuple[int, str], Stamp] = {}
        for k in known.values():
            where = (k.ref.step, k.ref.name)
            if where in out:
                continue
            st = old.get(where)
            if st is None and self._seed_root is not None:
                st = file_stamp(self._seed_root, *where)
            if st is not None:
                out[where] = st
        return out

    def failed(self, ij: "IncrementalJob") -> None:
        """The save of ``ij`` failed (persist thread)."""
        with self._lock:
            if ij.full:
                self._force_full = True  # a full save failed: the next one is full
            self._unpin(ij)

    def _unpin(self, ij: IncrementalJob) -> None:
        self._pins.subtract(ij.pinned)
        self._pins = +self._pins
        ij.pinned = ()

    def close(self) -> None:
        """Stop the crc threads (caller's thread, ``Checkpointer.close`` after the pipeline)."""
        self._cpu_crc.close()

    # -- any thread ---------------------------------------------------------------------------
    def protected(self, *, own: bool = False) -> set[int]:
        """Steps retention must keep: pinned by saves in flight, referenced by the base, and
        (multi-rank, unless ``own``: what a save's fragment reports, :mod:`..distributed.commit`)
        what the other ranks reported in the last commit round."""
        with self._lock:
            return set(self._pins) | {k.ref.step for k in self._known.values()} | (set() if own else self._peer)

    def set_peer_protected(self, steps: set[int]) -> None:
        """The other ranks' :meth:`protected` as of the commit round that is committing now
        (persist thread of the rank(s) running retention, :func:`..distributed.commit.commit_round`).
        Enough until the next round: a rank's base changes only to the step just committed."""
        with self._lock:
            self._peer = set(steps)

