"""Incremental saves: a tensor unchanged since the last committed step is referenced, not rewritten.

Who calls what, from which thread (one :class:`RefTracker` per ``Checkpointer``):

1. caller's thread, ``save()``: :meth:`RefTracker.prepare` records each tensor's
   *fingerprint* (torch's version counter, data pointer, shape, strides, dtype, device) — a
   few attribute reads per tensor, no data is touched. The plan keeps room for every tensor
   (the ring reserves the worst case), and the job's layout is marked "not final".
2. snapshot thread, first thing for the job: :meth:`RefTracker.decide` compares each tensor
   with what the newest committed step recorded under the same key and shrinks the plan to
   the tensors that must be written; the persist thread waits for this
   (``job.layout_ready``) before it creates the file, and releases the ring blocks the
   smaller file does not use. A tensor is referenced when
   - ``mode="crc"`` (``incremental=True``, the sound mode): its fingerprint did not change
     (or is unknown, e.g. after a restart) *and* the crc32c of its bytes, computed straight
     from the source memory (CPU: a read, no copy; CUDA: through a small pinned bounce
     buffer on the snapshot stream), equals the recorded crc32c. A changed version counter
     means "write" without computing anything (the persist thread checksums the staged
     bytes as for any save). Writes that bypass the version counter (``t.data[...] =``,
     numpy views, DLPack, extensions writing through ``data_ptr``) leave the fingerprint
     unchanged and are caught by the crc. A change is missed only if the new bytes have the
     same crc32c as the old ones (probability 2**-32 for an arbitrary change; crc32c
     detects every change of up to 3 bits in a tensor shorter than 512 MiB, and any burst
     up to 32 bits).
   - ``mode="version"`` (``incremental="version"``, faster: no read at all for unchanged
     tensors): an unchanged fingerprint alone. It misses a change made without bumping the
     version counter (the writes listed above), and a tensor replaced by another one at the
     same address with the same version count, shape, strides and dtype. Tensors without a
     version counter (inference tensors, numpy arrays) are still checked by crc.
3. persist thread: :meth:`before_commit` checks every referenced file is still there;
   :meth:`committed` (after the commit, before retention) makes this step the new base and
   unpins what the job referenced; :meth:`failed` unpins.
4. any thread running retention: :meth:`protected` — steps that a save in flight or the
   next save may reference (they must not be deleted even before a manifest names them).

References are flattened: an entry points at the step that wrote the bytes, never at a
step that itself references them. ``full_every=N``: at most ``N - 1`` incremental saves
follow a full one (a save that references nothing), which bounds how many steps depend on
one file and how long an old full step is kept alive by references.
"""

from __future__ import annotations

import collections
import ctypes
import logging
import os
import stat
import threading
from dataclasses import dataclass, field
from typing import Any, Callable

import crc32c as _crc
import torch

from ..errors import ConfigError, StorageError
from ..format.layout import HEADER_BYTES, align_up
from ..format.manifest import FileEntry, Manifest, TensorEntry
from ..format.refs import RefFile
from .job import SaveJob
from .plan import PlanItem, SavePlan

log = logging.getLogger("zerostall")

MODES = ("crc", "version")
_CRC_PIECE = 64 << 20  # crc32c releases the GIL per call; pieces keep one call short


def mode_of(incremental: Any) -> str | None:
    """``incremental`` as configured -> ``"crc"``, ``"version"`` or None (off)."""
    if incremental is False or incremental is None:
        return None
    if incremental is True:
        return "crc"
    if incremental in MODES:
        return str(incremental)
    raise ConfigError(f"incremental={incremental!r} is invalid: choose False, True (= 'crc') or 'version'")


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
    """What the newest committed step holds under one key."""

    entry: TensorEntry  # step set: the step (and file) that wrote the bytes
    ref: RefFile
    fp: tuple[Any, ...] | None


@dataclass
class IncrementalJob:
    """The incremental part of one save; owned by the snapshot thread until ``layout_ready``,
    read-only afterwards."""

    tracker: "RefTracker"
    fps: dict[str, tuple[Any, ...] | None]  # key -> fingerprint at save() time
    refs: dict[int, TensorEntry] = field(default_factory=dict)  # global tensor index -> reference
    ref_files: tuple[RefFile, ...] = ()
    pinned: tuple[int, ...] = ()
    full: bool = True
    crc_bytes: int = 0  # bytes checksummed from the source

    @property
    def bytes_referenced(self) -> int:
        return sum(e.nbytes for e in self.refs.values())


def _source_crc_cpu(t: torch.Tensor) -> int:
    if not t.is_contiguous():
        from .snapshot import _in_helper_thread  # a torch op, run outside the snapshot thread
        out: list[torch.Tensor] = []
        _in_helper_thread(lambda: out.append(t.contiguous()))
        t = out[0]
    n = t.numel() * t.element_size()
    base = t.data_ptr()
    crc = 0
    for pos in range(0, n, _CRC_PIECE):
        k = min(_CRC_PIECE, n - pos)
        crc = _crc.crc32c((ctypes.c_char * k).from_address(base + pos), crc)
    return crc


class _CudaCrc:
    """crc32c of device memory through a pinned bounce buffer, on the snapshot's stream."""

    def __init__(self, stream_fn: Callable[[], Any], piece: int = 16 << 20):
        self.stream_fn = stream_fn
        self.piece = piece
        self.buf: torch.Tensor | None = None

    def __call__(self, t: torch.Tensor) -> int:
        if self.buf is None:
            self.buf = torch.empty(self.piece, dtype=torch.uint8, pin_memory=True)
        stream = self.stream_fn()
        flat = (t if t.is_contiguous() else t.contiguous()).reshape(-1).view(torch.uint8)
        crc = 0
        for pos in range(0, flat.numel(), self.piece):
            k = min(self.piece, flat.numel() - pos)
            with torch.cuda.stream(stream):
                self.buf[:k].copy_(flat[pos:pos + k], non_blocking=True)
            stream.synchronize()
            crc = _crc.crc32c((ctypes.c_char * k).from_address(self.buf.data_ptr()), crc)
        return crc


class RefTracker:
    def __init__(self, mode: str, full_every: int | None):
        if mode not in MODES:
            raise ConfigError(f"incremental mode {mode!r}: choose one of {MODES}")
        if full_every is not None and full_every < 1:
            raise ConfigError(f"full_every={full_every!r} is invalid: must be >= 1 or None")
        self.mode = mode
        self.full_every = full_every
        self._lock = threading.Lock()
        self._known: dict[str, Known] = {}  # replaced, never mutated: readers keep a snapshot
        self._pins: collections.Counter[int] = collections.Counter()
        self._since_full = 0  # incremental decisions since the last full one (snapshot thread)
        self._force_full = False
        self._cuda_crc: _CudaCrc | None = None

    # -- start-up (caller's thread) --------------------------------------------------------
    def seed_from(self, steps: list[int], read_manifest: Callable[[int], Manifest]) -> None:
        """Start from the newest committed step of the root (if its manifest reads)."""
        if not steps:
            return
        try:
            man = read_manifest(steps[-1])
        except Exception as exc:  # noqa: BLE001 - no base: the first save is full
            log.info("zerostall: incremental: no base from step %d (%s); the first save is full", steps[-1], exc)
            return
        oldest = min((r.step for r in man.ref_files), default=man.step)
        self.seed(man, sum(1 for s in steps if s > oldest))

    def seed(self, manifest: Manifest, steps_after_oldest_ref: int) -> None:
        """Make ``manifest`` (the newest committed step of the root) the base: its tensors
        have no fingerprint, so the first save checks each by crc."""
        files = {f.name: RefFile(manifest.step, f.name, f.rank, f.file_bytes, f.file_id or manifest.checkpoint_id)
                 for f in manifest.files}
        refs = {(r.step, r.name): r for r in manifest.ref_files}
        known = {}
        for e in manifest.tensors:
            if e.step is None:
                ref = files[e.file]
                e = TensorEntry(e.key, e.dtype, e.shape, e.file, e.offset, e.nbytes, e.crc32c, manifest.step)
            else:
                ref = refs[(e.step, e.file)]
            known[e.key] = Known(e, ref, None)
        with self._lock:
            self._known = known
            self._since_full = steps_after_oldest_ref

    # -- caller's thread --------------------------------------------------------------------
    def prepare(self, job: SaveJob) -> None:
        job.incr = IncrementalJob(self, {leaf.key: fingerprint(leaf.tensor, leaf.numpy) for leaf in job.plan.leaves})
        job.layout_ready.clear()

    def pinned_steps(self) -> set[int]:
        with self._lock:
            return set(self._pins)

    # -- snapshot thread --------------------------------------------------------------------
    def decide(self, job: SaveJob, cuda_stream: Callable[[], Any]) -> None:
        """Choose what to reference; replace ``job.plan``/``job.leaves`` by what to write."""
        ij: IncrementalJob = job.incr
        with self._lock:
            known = self._known
            full = (not known or self._force_full or
                    (self.full_every is not None and self._since_full + 1 >= self.full_every))
            self._force_full = False
            self._since_full = 0 if full else self._since_full + 1
        ij.full = full
        if full:
            return
        plan, leaves = job.plan, list(job.leaves or ())
        keep_items: list[PlanItem] = []
        keep_leaves: list[torch.Tensor] = []
        refs: dict[int, TensorEntry] = {}
        ref_files: dict[tuple[int, str], RefFile] = {}
        for item, leaf in zip(plan.items, leaves):
            k = known.get(item.key)
            if k is not None and self._unchanged(item, leaf, ij.fps.get(item.key), k, job.step, cuda_stream, ij):
                e = k.entry
                refs[item.index] = TensorEntry(item.key, e.dtype, e.shape, e.file, e.offset, e.nbytes,
                                               e.crc32c, e.step)
                ref_files[(k.ref.step, k.ref.name)] = k.ref
            else:
                keep_items.append(item)
                keep_leaves.append(leaf)
        with self._lock:  # pin before anyone can see the smaller plan
            steps = tuple(sorted({s for s, _ in ref_files}))
            self._pins.update(steps)
            if not refs:
                self._since_full = 0  # nothing referenced: this is a full save
        ij.refs, ij.ref_files, ij.pinned = refs, tuple(ref_files.values()), steps
        ij.full = not refs
        off, items = HEADER_BYTES, []
        for it in keep_items:
            items.append(PlanItem(it.index, it.key, it.dtype, it.shape, it.nbytes, off))
            off = align_up(off + it.nbytes)
        job.plan = SavePlan(tuple(items), max(off, HEADER_BYTES), plan.tree,
                            tuple(lf for lf, it in zip(plan.leaves, plan.items) if it.index not in refs),
                            plan.n_tensors)
        job.leaves = keep_leaves

    def _unchanged(self, item: PlanItem, t: torch.Tensor, fp: Any, k: Known, step: int,
                   cuda_stream: Callable[[], Any], ij: IncrementalJob) -> bool:
        e = k.entry
        if e.step == step or e.dtype != item.dtype or e.shape != item.shape or e.nbytes != item.nbytes:
            return False
        if not item.nbytes:
            return False
        if fp is not None and k.fp is not None:
            if fp != k.fp:
                return False  # written by torch since: write it (no read needed)
            if self.mode == "version":
                return True
        ij.crc_bytes += item.nbytes
        if t.device.type == "cuda":
            if self._cuda_crc is None:
                self._cuda_crc = _CudaCrc(cuda_stream)
            crc = self._cuda_crc(t)
        else:
            crc = _source_crc_cpu(t)
        return crc == e.crc32c

    # -- persist thread -----------------------------------------------------------------------
    def before_commit(self, job: SaveJob, root: str) -> None:
        """Every referenced file is still a regular file of the recorded size."""
        for r in job.incr.ref_files if job.incr is not None else ():
            path = os.path.join(root, f"step-{r.step}", r.name)
            try:
                st = os.lstat(path)
            except OSError as exc:
                raise StorageError(f"{path}: referenced by step {job.step} but gone ({exc.strerror}); "
                                   "nothing committed", filename=path) from exc
            if not stat.S_ISREG(st.st_mode) or st.st_size != r.file_bytes:
                raise StorageError(f"{path}: referenced by step {job.step} but no longer the file it "
                                   "was; nothing committed", filename=path)

    def committed(self, job: SaveJob, file: FileEntry, written: list[tuple[int, TensorEntry]]) -> None:
        """``job`` is committed: its tensors (written or referenced) are the new base."""
        ij: IncrementalJob = job.incr
        own = RefFile(job.step, file.name, file.rank, file.file_bytes, file.file_id or job.checkpoint_id)
        refs_by = {(r.step, r.name): r for r in ij.ref_files}
        fps = ij.fps
        known: dict[str, Known] = {}
        for _, e in written:
            known[e.key] = Known(TensorEntry(e.key, e.dtype, e.shape, e.file, e.offset, e.nbytes, e.crc32c,
                                             job.step), own, fps.get(e.key))
        for e in ij.refs.values():
            known[e.key] = Known(e, refs_by[(e.step, e.file)], fps.get(e.key))
        with self._lock:
            self._known = known
            self._unpin(ij)

    def failed(self, job: SaveJob) -> None:
        ij: IncrementalJob | None = job.incr
        if ij is None:
            return
        with self._lock:
            if ij.full:
                self._force_full = True  # a full save failed: the next one is full
            self._unpin(ij)

    def _unpin(self, ij: IncrementalJob) -> None:
        self._pins.subtract(ij.pinned)
        self._pins = +self._pins
        ij.pinned = ()

    # -- any thread ---------------------------------------------------------------------------
    def protected(self) -> set[int]:
        """Steps retention must keep: pinned by saves in flight, or referenced by the base."""
        with self._lock:
            return set(self._pins) | {k.ref.step for k in self._known.values()}


def manifest_parts(job: SaveJob, written: list[tuple[int, TensorEntry]]) -> tuple[tuple[TensorEntry, ...],
                                                                                   tuple[RefFile, ...]]:
    """The manifest's ``tensors`` (written and referenced, in global index order) and ``ref_files``."""
    ij: IncrementalJob | None = job.incr
    if ij is None or not ij.refs:
        return tuple(e for _, e in written), ()
    merged = dict(written)
    merged.update(ij.refs)
    return tuple(merged[i] for i in sorted(merged)), ij.ref_files
