"""The content check of incremental saves: is a tensor's source still the base's bytes, and is
the base file still the file that was written?

A mixin of :class:`.incremental.RefTracker` (it uses the tracker's state), split out so that
each module reads as one concern. Every method runs on the snapshot thread: the verdicts inside
:meth:`RefTracker.decide`, :meth:`ContentCheck.settle` right before a job is marked staged.

A tensor is referenced when its fingerprint did not change and, in ``mode="crc"``, its bytes
are the base's (CPU: crc32c of the source memory; CUDA: :func:`.source_crc.device_hash_async`,
else crc32c through one pinned buffer); ``mode="version"`` trusts the fingerprint alone (tensors
without a version counter are still crc-checked). What each mode can miss: docs/incremental.md.

The CPU crc does not hold up the write: undecided CPU tensors are referenced on speculation
(:meth:`ContentCheck._speculate`) and :meth:`ContentCheck.settle` appends any that turned out
changed (``Job.extension``); not for a base read from disk nor when CUDA tensors are undecided.

A base file (:func:`base_file_problem`): an ``lstat`` of the step's manifest and of the file,
and a read of its 4 KiB header, once per file a save would borrow from. A write into the file
since it was committed is caught by its stamp (inode, size, mtime, ctime: :func:`file_stamp`);
the ctime catches a rewrite whose tool put the mtime back (``rsync --inplace -t``). Bit rot
below the filesystem is found by restore and ``verify`` (crc32c of every byte).
"""

from __future__ import annotations

import logging
import os
import stat
from typing import TYPE_CHECKING, Any, Callable

import torch

from ..errors import StorageError
from ..format.layout import HEADER_BYTES, ShardHeader
from ..format.manifest import MANIFEST_NAME
from ..format.refs import RefFile
from .job import SaveRequest, Slot
from .plan import PlanItem, SavePlan, repack
from .source_crc import _file_crc, _nofollow, device_hash_async

if TYPE_CHECKING:
    from .incremental import IncrementalJob, Known

log = logging.getLogger("zerostall")

Stamp = tuple[int, int, int, int]


def file_stamp(root: str, step: int, name: str) -> Stamp | None:
    """(inode, size, mtime, ctime in ns) of ``root/step-<step>/<name>``; None if it cannot be read."""
    try:
        st = os.lstat(os.path.join(root, f"step-{step}", name))
    except OSError:
        return None
    return _stamp(st)


def _stamp(st: os.stat_result) -> Stamp:
    return (st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns)


def base_file_problem(root: str, ref: RefFile, stamp: Stamp | None = None) -> str | None:
    """Why ``ref`` can no longer be referenced (its step's manifest or the file itself is
    gone, the file is not a regular file of the recorded size, it was written to since
    ``stamp``, or its header is another's), or None if it is still the file that was written."""
    step_dir = os.path.join(root, f"step-{ref.step}")
    try:
        if not stat.S_ISREG(os.lstat(os.path.join(step_dir, MANIFEST_NAME)).st_mode):
            return "its manifest is not a regular file"
        path = os.path.join(step_dir, ref.name)
        st = os.lstat(path)
        if not stat.S_ISREG(st.st_mode):
            return "not a regular file"
        if st.st_size != ref.file_bytes:
            return f"{st.st_size} bytes, {ref.file_bytes} recorded"
        if stamp is not None and _stamp(st) != stamp:
            return "written to, replaced or re-linked since it was committed (its inode, mtime or ctime changed)"
        with open(path, "rb", buffering=0, opener=_nofollow) as f:
            head = f.read(HEADER_BYTES)
    except OSError as exc:
        return exc.strerror or str(exc)
    if not ShardHeader(ref.file_id, ref.step, ref.rank, ref.file_bytes).matches(head):
        return "its header is not the one written (replaced or damaged)"
    return None


def _on_device(t: torch.Tensor) -> bool:
    """Whether ``t`` is checked on its device (the seam tests use to run the device path on the CPU)."""
    return t.device.type == "cuda"


class ContentCheck:
    """Per-tensor verdicts (False: write, True: reference, None: undecided), snapshot thread."""

    mode: str
    _cpu_crc: Any
    _cuda_crc: Any
    _seeded: bool
    _seed_root: str | None
    _dh_warned: bool
    _lock: Any
    _since_full: int

    def _speculate(self, plan: SavePlan, leaves: list[torch.Tensor], known: dict[str, Known],
                   verdict: list[bool | None], ij: IncrementalJob) -> bool:
        """Start the crc32c of the undecided CPU tensors on the crc threads and reference them
        on speculation, so that the tensors that must be written are staged and written while
        the crc runs (:meth:`settle` appends any that changed). Not for a base read from disk
        (checked synchronously, with its file spans) nor with undecided CUDA tensors."""
        undecided = [i for i, v in enumerate(verdict) if v is None]
        if not undecided or self._seeded or any(_on_device(leaves[i]) for i in undecided):
            return False
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
        wait for the speculative crc32c (:meth:`_speculate`); a tensor whose bytes changed is
        no longer referenced but appended after the blocks already staged (in the spare block
        the ring holds per incremental save). Returns the extended plan and the tensors to
        stage after ``spec``'s, or None."""
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
        start = -(-spec.file_bytes // block_bytes) * block_bytes  # the blocks staged so far stay as they are
        ext = repack(spec, [it for it, _, _ in changed], [lf for _, lf, _ in changed], start, len(spec.items))
        if slot.g0 + -(-ext.file_bytes // block_bytes) > slot.g_end:  # cannot happen with the spare block
            raise StorageError(f"step {req.step}: {len(changed)} tensor(s) changed without their version counter "
                               "and do not fit the staging blocks reserved for this save; nothing committed")
        log.info("zerostall: incremental: step %d: %d tensor(s) changed without a version-counter bump "
                 "(e.g. %r); written, not referenced", req.step, len(changed), changed[0][0].key)
        return ext, [t for _, _, t in changed]

    def _fast_path(self, item: PlanItem, fp: Any, k: Known, step: int) -> bool | None:
        """False: write; True: reference (``"version"`` mode only); None: ask the crc."""
        e = k.entry
        # a manifest may only reference earlier steps (allow_lower_steps, overwrite: write it); nor empty tensors
        if e.step >= step or e.dtype != item.dtype or e.shape != item.shape or e.nbytes != item.nbytes or not e.nbytes:
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
            for i, crc in zip(cpu, self._cpu_crc.many([leaves[i] for i in cpu])):
                verdict[i] = crc == known[ij.paths[items[i].index]].entry.crc32c
        ij.crc_bytes += sum(items[i].nbytes for i in cpu)
        for i in gpu:
            k, h = known[ij.paths[items[i].index]], ij.dhs.get(items[i].index)
            if k.dh is not None and h is not None:  # hashed on the device: 8 bytes came back
                verdict[i] = h == k.dh
                ij.dev_hash_bytes += items[i].nbytes
                continue  # else no device hash of the base (restart, non-contiguous): the crc
            verdict[i] = self._cuda_crc(leaves[i], cuda_run) == k.entry.crc32c
            ij.crc_bytes += items[i].nbytes

    def _device_hashes(self, items: Any, leaves: list[torch.Tensor],
                       cuda_run: Callable[[torch.device, Callable[[], None]], None], ij: IncrementalJob) -> None:
        """:func:`.source_crc.device_hash_async` of every contiguous CUDA tensor of the save (written
        ones too: the next save compares against them), on each device's side stream after
        the caller's ``save()`` event; one 8-byte-per-tensor copy back per device. A failure
        (e.g. out of device memory for the temporaries) leaves the crc path to decide."""
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
