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
   smaller file does not use. A tensor is referenced when
   - ``mode="crc"`` (``incremental=True``, the sound mode): its fingerprint did not change
     (or is unknown, e.g. after a restart) *and* its bytes are those of the base: on the
     CPU, the crc32c of the source memory (a read, no copy, in 16 MiB pieces on up to 4
     threads, combined) equals the recorded crc32c; on CUDA, a 64-bit hash computed on the
     device (:mod:`.devhash`: one read of the tensor in device memory, 8 bytes per tensor
     back to the host) equals the hash taken when the base was saved — every CUDA tensor
     of a crc-mode save is hashed (written ones too) for that. Where no such hash exists
     (the first save after a restart: the base came from disk; a non-contiguous tensor;
     the hash failed, e.g. out of device memory for its 64 MiB of temporaries), the tensor
     is copied to the host through one 16 MiB pinned buffer and crc32c-checked: one
     device-to-host read of it, piece after piece. A changed version counter
     means "write" without computing anything (the persist thread checksums the staged
     bytes as for any save). Writes that bypass the version counter (``t.data[...] =``,
     numpy views, DLPack, extensions writing through ``data_ptr``) leave the fingerprint
     unchanged and are caught by the crc (or the device hash). A change is missed only if
     the new bytes have the same crc32c as the old ones (probability 2**-32 for an
     arbitrary change; crc32c detects every change of up to 3 bits in a tensor shorter than
     512 MiB, and any burst up to 32 bits), or on CUDA the same device hash (every change
     confined to one 32-bit word is detected; about 2**-32 or less otherwise).
   - ``mode="version"`` (``incremental="version"``, faster: no read at all for unchanged
     tensors): an unchanged fingerprint alone. It misses a change made without bumping the
     version counter (the writes listed above), and a tensor replaced by another one at the
     same address with the same version count, shape, strides and dtype. Tensors without a
     version counter (inference tensors, numpy arrays) are still checked by crc.
   The CPU crc does not hold up the write (:meth:`RefTracker._speculate`): the undecided CPU
   tensors are referenced on speculation while their crc runs on the crc threads, the
   changed tensors are staged and written meanwhile, and :meth:`RefTracker.settle` (snapshot
   thread, before ``staged``) appends any that turned out changed after the blocks already
   staged (``Job.extension``; the persist thread writes them and rewrites the
   header with the final size). Not done for a base read from disk (checked synchronously
   with its file spans) nor when CUDA tensors are undecided.
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
import logging
import os
import stat
import threading
from dataclasses import dataclass, field
from typing import Any, Callable

import torch

from ..errors import ConfigError, StorageError
from ..format.layout import HEADER_BYTES, align_up
from ..format.manifest import FileEntry, Manifest, TensorEntry
from ..format.refs import RefFile
from ..format.tree import tensor_paths
from .basefiles import Stamp, base_file_problem, file_stamp
from .job import Persisted, SaveRequest, Slot
from .plan import PlanItem, SavePlan
from .source_crc import CRC_THREADS, _CpuCrc, _CudaCrc, _file_crc  # noqa: F401 - _CpuCrc: tests

log = logging.getLogger("zerostall")

MODES = ("crc", "version")


def _on_device(t: torch.Tensor) -> bool:
    """Whether ``t`` is checked on its device (the seam tests use to run the device path on the CPU)."""
    return t.device.type == "cuda"


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
    """What the newest committed step holds at one tree path (:func:`..format.tree.tensor_paths`)."""

    entry: TensorEntry  # step set: the step (and file) that wrote the bytes
    ref: RefFile
    fp: tuple[Any, ...] | None
    dh: int | None = None  # CUDA tensors: :func:`.devhash.device_hash` of these bytes, if computed


@dataclass
class IncrementalJob:
    """The incremental part of one save; owned by the snapshot thread until ``layout_ready``,
    read-only afterwards."""

    tracker: "RefTracker"
    fps: dict[int, tuple[Any, ...] | None]  # tensor index -> fingerprint at save() time
    paths: dict[int, str] = field(default_factory=dict)
    """Tensor index -> its typed tree path (:func:`..format.tree.tensor_paths`): the identity
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


class RefTracker:
    def __init__(self, mode: str, full_every: int | None):
        if mode not in MODES:
            raise ConfigError(f"incremental mode {mode!r}: choose one of {MODES}")
        if full_every is not None and full_every < 1:
            raise ConfigError(f"full_every={full_every!r} is invalid: must be >= 1 or None")
        self.mode = mode
        self.full_every = full_every
        self._lock = threading.Lock()
        self._known: dict[str, Known] = {}  # by tree path; replaced, never mutated: readers keep a snapshot
        self._paths: tuple[Any, dict[int, str]] = (None, {})  # (tree, its tensor paths): the plan cache reuses trees
        self._pins: collections.Counter[int] = collections.Counter()
        self._since_full = 0  # incremental decisions since the last full one (snapshot thread)
        self._force_full = False
        self._cuda_crc: _CudaCrc | None = None
        self._cpu_crc: _CpuCrc | None = None
        self._seed_root: str | None = None
        self._seeded = False  # the base came from disk, not from a save of this process
        self._peer: set[int] = set()  # other ranks' protected steps (multi-rank; set_peer_protected)
        self._lost_warned: set[int] = set()  # base steps found gone or damaged (warned once each)
        self._stamps: dict[tuple[int, str], Stamp] = {}  # base files as they were (basefiles.file_stamp)
        self._dh_warned = False

    # -- start-up (caller's thread) --------------------------------------------------------
    def seed_from(self, steps: list[int], read_manifest: Callable[[int], Manifest], root: str | None = None, *,
                  rank: int = 0, world_size: int = 1) -> None:
        """Start from the newest committed step of the root (if its manifest reads).

        Its files were written by another process and may have been damaged since (a restart
        often follows a load that fell back past them): with ``root``, the first save reads
        back and crc-checks every file span it would reference (:meth:`_verify_on_disk`), and
        writes the tensor instead when it does not match."""
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
        oldest = min((r.step for r in man.ref_files), default=man.step)
        self.seed(man, sum(1 for s in steps if s > oldest), rank=rank)

    def seed(self, manifest: Manifest, steps_after_oldest_ref: int, *, rank: int = 0) -> None:
        """Make ``manifest`` (the newest committed step of the root) the base: its tensors
        have no fingerprint, so the first save checks each by crc. Only ``rank``'s own files
        count: a rank references nothing but bytes it wrote (keys repeat across ranks)."""
        files = {f.name: RefFile(manifest.step, f.name, f.rank, f.file_bytes, f.file_id or manifest.checkpoint_id)
                 for f in manifest.files}
        refs = {(r.step, r.name): r for r in manifest.ref_files}
        known = {}
        paths = tensor_paths(manifest.tree_for(rank, manifest.world_size))
        for i, e in enumerate(manifest.tensors):
            if i not in paths:  # another rank's tensor (per-rank trees)
                continue
            if e.step is None:
                ref = files[e.file]
                e = TensorEntry(e.key, e.dtype, e.shape, e.file, e.offset, e.nbytes, e.crc32c, manifest.step)
            else:
                ref = refs[(e.step, e.file)]
            if ref.rank == rank:
                known[paths[i]] = Known(e, ref, None)
        stamps = self._stamps_of(known, {})
        with self._lock:
            self._known = known
            self._stamps = stamps
            self._since_full = steps_after_oldest_ref
            self._seeded = self._seed_root is not None

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
        ij.paths = self._tensor_paths(plan.tree)
        with self._lock:
            known = self._known
            full = (not known or self._force_full or
                    (self.full_every is not None and self._since_full + 1 >= self.full_every))
            self._force_full = False
            self._since_full = 0 if full else self._since_full + 1
        if not full:
            known = self._usable(known, req.step)
            if not known:  # the whole base is lost: a full save
                full = True
                with self._lock:
                    self._since_full = 0
        ij.full = full
        leaves = list(leaves)
        if self.mode == "crc" and any(_on_device(t) for t in leaves):  # full saves too: the next compares
            self._device_hashes(plan.items, leaves, cuda_run, ij)
        if full:
            return plan, leaves
        keep_items: list[PlanItem] = []
        keep_leaves: list[torch.Tensor] = []
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
        for item, leaf, ok in zip(plan.items, leaves, verdict):
            if ok:
                k = known[paths[item.index]]
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
        return SavePlan(tuple(items), max(off, HEADER_BYTES), plan.tree,
                        tuple(lf for lf, it in zip(plan.leaves, plan.items) if it.index not in refs),
                        plan.n_tensors, plan.tree_json), keep_leaves

    def _usable(self, known: dict[str, Known], step: int) -> dict[str, Known]:
        """``known`` less what lives in a base file that is gone or no longer the file it was
        (step deleted by hand or by another tool, manifest removed, file truncated, replaced,
        swapped for a symlink): those tensors are written by this save instead of referenced,
        and each lost base step is reported once (snapshot thread; per referenced file an
        ``lstat`` and a read of its 4 KiB header). Without this, every save until the next
        full one failed at its commit and training went on with no new checkpoint."""
        if self._seed_root is None:
            return known
        files = {(k.ref.step, k.ref.name): k.ref for k in known.values()}
        stamps = self._stamps
        lost = {}
        for where, ref in files.items():
            why = base_file_problem(self._seed_root, ref, stamps.get(where))
            if why is not None:
                lost[where] = why
        if not lost:
            return known
        for (s, name), why in sorted(lost.items()):
            if s not in self._lost_warned:
                self._lost_warned.add(s)
                n = sum(1 for k in known.values() if (k.ref.step, k.ref.name) == (s, name))
                log.warning("zerostall: incremental: base step %d is gone or damaged (%s: %s); step %d writes "
                            "the %d tensor(s) it would have referenced there", s, name, why, step, n)
        return {p: k for p, k in known.items() if (k.ref.step, k.ref.name) not in lost}

    def _speculate(self, plan: SavePlan, leaves: list[torch.Tensor], known: dict[str, Known],
                   verdict: list[bool | None], ij: IncrementalJob) -> bool:
        """Start the crc32c of the undecided CPU tensors on the crc threads and reference them
        on speculation, so that the tensors that must be written are staged and written while
        the crc runs (:meth:`settle` appends any that changed). Not for a base read from disk
        (checked synchronously, with its file spans) nor with undecided CUDA tensors."""
        undecided = [i for i, v in enumerate(verdict) if v is None]
        if not undecided or self._seeded or any(_on_device(leaves[i]) for i in undecided):
            return False
        if self._cpu_crc is None:
            self._cpu_crc = _CpuCrc(CRC_THREADS)
        collect = self._cpu_crc.submit([leaves[i] for i in undecided])
        ij.pending = (collect, [(plan.items[i], plan.leaves[i], leaves[i],
                                 known[ij.paths[plan.items[i].index]].entry.crc32c) for i in undecided])
        ij.crc_bytes += sum(plan.items[i].nbytes for i in undecided)
        for i in undecided:
            verdict[i] = True
        return True

    def settle(self, req: SaveRequest, slot: Slot, spec: SavePlan, block_bytes: int,
               ij: "IncrementalJob") -> tuple[SavePlan, list[torch.Tensor]] | None:
        """Snapshot thread, after the job's layout is staged and before it is marked staged:
        wait for the speculative crc32c (:meth:`_speculate`); a tensor whose bytes changed
        (written around its version counter) is no longer referenced but appended to the
        file, after the blocks already staged. Returns the extended plan and the tensors to
        stage after ``spec``'s (the snapshot thread hands the plan to the persist thread
        first, which writes the appended blocks as they are staged, then the final header),
        or None. The ring holds one spare block per incremental save for this."""
        if ij.pending is None:
            return None
        collect, cands = ij.pending
        ij.pending = None
        changed = [(it, leaf, t) for (it, leaf, t, want), crc in zip(cands, collect()) if crc != want]
        if not changed:
            return None
        for it, _, _ in changed:
            del ij.refs[it.index]
        used = {(e.step, e.file) for e in ij.refs.values()}
        ij.ref_files = tuple(r for r in ij.ref_files if (r.step, r.name) in used)
        if not ij.refs:
            ij.full = True
            with self._lock:
                self._since_full = 0
        off = -(-spec.file_bytes // block_bytes) * block_bytes  # the blocks staged so far stay as they are
        new = []
        for it, _, _ in changed:
            new.append(PlanItem(it.index, it.key, it.dtype, it.shape, it.nbytes, off))
            off = align_up(off + it.nbytes)
        if slot.g0 + -(-off // block_bytes) > slot.g_end:  # cannot happen with the spare block; never write past
            raise StorageError(f"step {req.step}: {len(new)} tensor(s) changed without their version counter "
                               "and do not fit the staging blocks reserved for this save; nothing committed")
        log.info("zerostall: incremental: step %d: %d tensor(s) changed without a version-counter bump "
                 "(e.g. %r); written, not referenced", req.step, len(new), new[0].key)
        return SavePlan(spec.items + tuple(new), off, spec.tree, spec.leaves + tuple(lf for _, lf, _ in changed),
                        spec.n_tensors, spec.tree_json), [t for _, _, t in changed]

    def _fast_path(self, item: PlanItem, fp: Any, k: Known, step: int) -> bool | None:
        """False: write; True: reference (``"version"`` mode only); None: ask the crc."""
        e = k.entry
        # a manifest may only reference earlier steps (allow_lower_steps, overwrite: write it)
        if e.step >= step or e.dtype != item.dtype or e.shape != item.shape or e.nbytes != item.nbytes:
            return False
        if not item.nbytes:
            return False
        if fp is not None and k.fp is not None:
            if fp != k.fp:
                return False  # written by torch since: write it (no read needed)
            if self.mode == "version":
                return True
        return None

    def _confirm(self, items: Any, leaves: list[torch.Tensor], known: dict[str, Known], verdict: list[bool | None],
                 cuda_run: Callable[[torch.device, Callable[[], None]], None], ij: IncrementalJob) -> None:
        """Settle every undecided verdict by the crc32c of the source (CPU tensors in parallel)."""
        cpu = [i for i, v in enumerate(verdict) if v is None and not _on_device(leaves[i])]
        gpu = [i for i, v in enumerate(verdict) if v is None and _on_device(leaves[i])]
        if cpu:
            if self._cpu_crc is None:
                self._cpu_crc = _CpuCrc(CRC_THREADS)
            for i, crc in zip(cpu, self._cpu_crc.many([leaves[i] for i in cpu])):
                verdict[i] = crc == known[ij.paths[items[i].index]].entry.crc32c
        ij.crc_bytes += sum(items[i].nbytes for i in cpu)
        for i in gpu:
            k, h = known[ij.paths[items[i].index]], ij.dhs.get(items[i].index)
            if k.dh is not None and h is not None:  # hashed on the device: 8 bytes came back
                verdict[i] = h == k.dh
                ij.dev_hash_bytes += items[i].nbytes
                continue
            if self._cuda_crc is None:  # no device hash of the base (restart, non-contiguous)
                self._cuda_crc = _CudaCrc()
            verdict[i] = self._cuda_crc(leaves[i], cuda_run) == k.entry.crc32c
            ij.crc_bytes += items[i].nbytes

    def _device_hashes(self, items: Any, leaves: list[torch.Tensor],
                       cuda_run: Callable[[torch.device, Callable[[], None]], None], ij: IncrementalJob) -> None:
        """:func:`.devhash.device_hash` of every contiguous CUDA tensor of the save (written
        ones too: the next save compares against them), on each device's side stream after
        the caller's ``save()`` event; one 8-byte-per-tensor copy back per device. A failure
        (e.g. out of device memory for the temporaries) leaves the crc path to decide."""
        from .devhash import device_hash_async
        by_dev: dict[torch.device, list[int]] = {}
        for i, (it, t) in enumerate(zip(items, leaves)):
            if _on_device(t) and it.nbytes and t.is_contiguous():
                by_dev.setdefault(t.device, []).append(i)
        for dev, idx in by_dev.items():
            out: list[torch.Tensor] = []
            try:
                cuda_run(dev, lambda idx=idx: out.append(torch.stack([device_hash_async(leaves[i]) for i in idx])))
                vals = out[0].tolist()
            except Exception as exc:  # noqa: BLE001 - the crc path is always there
                if not self._dh_warned:
                    self._dh_warned = True
                    log.warning("zerostall: incremental: hashing tensors on %s failed (%s); checking them through "
                                "the host instead", dev, exc)
                continue
            for i, v in zip(idx, vals):
                ij.dhs[items[i].index] = int(v)

    def _tensor_paths(self, tree: Any) -> dict[int, str]:
        """:func:`..format.tree.tensor_paths` of ``tree``, kept for the next save: the plan
        cache hands the same tree object back while the state keeps its shape (snapshot thread)."""
        cached_tree, paths = self._paths
        if cached_tree is not tree:
            paths = tensor_paths(tree)
            self._paths = (tree, paths)
        return paths

    def _verify_on_disk(self, items: Any, known: dict[str, Known], verdict: list[bool | None],
                        paths: dict[int, str]) -> None:
        """First save on a base read from disk: a span whose bytes on disk no longer match
        their crc32c is written, not referenced (snapshot thread; plain reads)."""
        checked: dict[tuple[int, str, int], bool] = {}
        for i, ok in enumerate(verdict):
            if not ok:
                continue
            e = known[paths[items[i].index]].entry
            where = (e.step, e.file, e.offset)
            if where not in checked:
                path = os.path.join(self._seed_root or "", f"step-{e.step}", e.file)
                checked[where] = _file_crc(path, e.offset, e.nbytes) == e.crc32c
                if not checked[where]:
                    log.warning("zerostall: incremental: %s: %r no longer matches its crc32c on disk; "
                                "writing it again instead of referencing it", path, e.key)
            verdict[i] = checked[where]

    # -- persist thread -----------------------------------------------------------------------
    def before_commit(self, job: Persisted, root: str) -> None:
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
        with self._lock:
            self._known = known
            self._stamps = stamps
            self._seeded = False  # every reference of the new base was checked or written here
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
        if self._cpu_crc is not None:
            self._cpu_crc.close()
            self._cpu_crc = None

    # -- any thread ---------------------------------------------------------------------------
    def protected(self) -> set[int]:
        """Steps retention must keep: pinned by saves in flight, referenced by the base, or
        (multi-rank) what the other ranks reported in the last commit round."""
        with self._lock:
            return self._own() | self._peer

    def own_protected(self) -> set[int]:
        """Steps this rank's saves may reference: pinned by saves in flight, or referenced by
        the base (a multi-rank save's fragment reports them, :mod:`..distributed.commit`)."""
        with self._lock:
            return self._own()

    def _own(self) -> set[int]:
        return set(self._pins) | {k.ref.step for k in self._known.values()}

    def set_peer_protected(self, steps: set[int]) -> None:
        """The other ranks' :meth:`protected` as of the commit round that is committing now
        (persist thread of the rank(s) running retention, :func:`..distributed.commit.commit_round`).

        Enough until the next round: a rank's pins are always steps its base references, and
        its base changes only when it learns that a round committed (after it reported), to
        the step just committed (never deleted: the newest) whose references retention
        counts from its manifest."""
        with self._lock:
            self._peer = set(steps)


def merged_entries(job: Persisted, written: list[tuple[int, TensorEntry]]) -> tuple[list[tuple[int, TensorEntry]],
                                                                                   tuple[RefFile, ...]]:
    """(global tensor index, entry) for every tensor of this rank, written and referenced, in
    index order, and the files the references live in (a multi-rank save's fragment)."""
    ij: IncrementalJob | None = job.incr
    if ij is None or not ij.refs:
        return list(written), ()
    merged = dict(written)
    merged.update(ij.refs)
    return sorted(merged.items()), ij.ref_files


def manifest_parts(job: Persisted, written: list[tuple[int, TensorEntry]]) -> tuple[tuple[TensorEntry, ...],
                                                                                   tuple[RefFile, ...]]:
    """The manifest's ``tensors`` (written and referenced, in global index order) and ``ref_files``."""
    entries, ref_files = merged_entries(job, written)
    return tuple(e for _, e in entries), ref_files
