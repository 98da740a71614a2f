"""Loading one step: manifest, files, destinations, then every byte through :mod:`.stream`.

Caller's thread: :func:`.pipeline.load` (per candidate step) and the CLI (``verify_step``).
Any :class:`~zerostall.store.tier.Tier` serves (``stat`` checks sizes before anything is
allocated; ``open_shard_read`` opens each file). With a ``state_dict``, tensors of matching
shape and dtype are filled in place, transactionally (:func:`read_step`); else new tensors,
then ``map_location`` (a CUDA device it names is filled directly). ``keys=[...]`` and an
incremental step's borrowed files read only the byte ranges needed.
"""

from __future__ import annotations

import contextlib
import logging
import threading
from dataclasses import replace
from types import SimpleNamespace
from typing import Any, Callable

import torch

from ..config import IOConfig
from ..errors import CheckpointNotFound, CorruptCheckpoint, StateMismatchError, ZerostallError
from ..format.dtypes import dtype_from_name
from ..format.layout import PAGE_ITEM_BYTES, ShardHeader
from ..format.manifest import Manifest, TensorEntry
from ..format.refs import RefFile
from ..format.validate import bad
from ..format.decode import decode_tree, tree_tensor_indices
from ..io.base import Engine
from ..memory.arena import Arena
from ..store.local import LocalTier
from ..store.tier import Tier
from .device_copy import cuda_target
from .state import LoadReport, LoadRequest, find_in_place, key_report, location_mapper, merge, overlapping, select_keys
from . import stream
from .stream import FileRead, Plan, Stats, aligned_empty

log = logging.getLogger("zerostall")

BOUNCE_BYTES = 128 << 20
_bounce_lock = threading.Lock()
_bounce_made = threading.Lock()
_bounce: Arena | None = None
last_stats: Stats | None = None  # what the last read of this process did (bench and tests; no API)


def shared_bounce() -> Arena:
    """The process's restore scratch when no staging pool lends one (faulted once, reused). Any
    thread (a peer restore faults it while the node's files are fetched); a second caller waits."""
    global _bounce
    with _bounce_made:
        if _bounce is None:
            _bounce = Arena(BOUNCE_BYTES, mlock=False)
        return _bounce


def shard_where(tier: Tier, step: int, name: str) -> str:
    """How messages name file ``name`` of ``step`` on ``tier`` (a path for a local tier)."""
    return f"{tier.url.rstrip('/')}/step-{step}/{name}"


def check_size(tier: Tier, step: int, name: str, want: int, recorded_by: str = "manifest says") -> None:
    """Shard ``step-N/<name>`` on ``tier`` is a regular file of ``want`` bytes, else
    :class:`CorruptCheckpoint` naming it and ``recorded_by`` (who recorded that size)."""
    path = shard_where(tier, step, name)
    size = tier.stat(f"step-{step}/{name}")
    if size is None:
        raise bad(path, f"shard file is missing or not a regular file ({recorded_by} {want} bytes)")
    if size != want:
        raise bad(path, f"shard is {size} bytes, {recorded_by} {want} (truncated or replaced)")


def check_ref_files(tier: Tier, man: Manifest, refs: list[RefFile]) -> None:
    """An incremental step's borrowed files (:mod:`.format.refs`) each belong to a committed
    step whose manifest lists it with the same size and id, and have that size; else
    :class:`CorruptCheckpoint` naming it. Before anything is allocated or read."""
    manifests: dict[int, Manifest] = {}
    for r in refs:
        where = f"step {man.step} references step-{r.step}/{r.name}"
        step_where = shard_where(tier, r.step, "").rstrip("/")
        if r.step not in manifests:
            try:
                manifests[r.step] = tier.read_manifest(r.step)
            except CheckpointNotFound:
                raise CorruptCheckpoint(f"{where}, but step {r.step} is not a committed checkpoint in "
                                        f"{tier.url!r} (deleted?)", path=step_where) from None
        fe = next((f for f in manifests[r.step].files if f.name == r.name), None)
        if fe is None or fe.file_bytes != r.file_bytes or (fe.file_id or manifests[r.step].checkpoint_id) != r.file_id:
            raise CorruptCheckpoint(f"{where}, but step {r.step}'s manifest does not list that file as "
                                    "recorded (step overwritten?)", path=step_where)
        check_size(tier, r.step, r.name, r.file_bytes, f"{where} with")


def file_read(tier: Tier, step: int, name: str, file_bytes: int, header: ShardHeader, man: Manifest,
              idx: list[int], dst: Callable[[int], Any], engine: Any, *, sparse: bool = True) -> FileRead:
    """The :class:`~.stream.FileRead` of ``step-N/<name>`` for manifest entries ``idx``, each into
    ``dst(i)`` (:func:`file_reads`); ``sparse``: only their extents (and the header)."""
    idx = sorted(idx, key=lambda i: man.tensors[i].offset)
    fr = FileRead(shard_where(tier, step, name), file_bytes, header, [man.tensors[i] for i in idx], [],
                  lambda: tier.open_shard_read(step, name, engine), wanted=set(range(len(idx))) if sparse else None)
    for k, i in enumerate(idx):
        flat, direct, protected, *device = dst(i)
        fr.dsts.append(flat)
        if direct is not None:
            fr.direct[k] = direct
        if protected:
            fr.protect.add(k)
        if device and device[0] is not None:  # CUDA memory: flat uint8 bytes at address ``flat``
            fr.device[k] = device[0]
    return fr


def check_files(tier: Tier, man: Manifest, only: set[str] | None = None, engine: Engine | None = None) -> None:
    """Every shard is a regular file (no symlink, FIFO, device) of the recorded size. Runs before
    anything is allocated, so a hostile manifest cannot make us allocate what the files lack."""
    for fe in man.files:
        if only is not None and fe.name not in only:
            continue
        tier.open_shard_read(man.step, fe.name, engine).close()  # refuses a missing file, a symlink, a FIFO...
        check_size(tier, man.step, fe.name, fe.file_bytes)
    if man.ref_files:  # files of earlier steps this (incremental) step borrows from
        check_ref_files(tier, man, [r for r in man.ref_files if only is None or r.name in only])


def _meminfo(*keys: str) -> int:
    """The sum of ``keys`` (``MemAvailable``, ``MemTotal``, ``SwapTotal``), in bytes."""
    import psutil  # here: ``import zerostall`` does not load it

    vm, swap = psutil.virtual_memory(), psutil.swap_memory()
    return sum({"MemAvailable": vm.available, "MemTotal": vm.total, "SwapTotal": swap.total}[k] for k in keys)


def _new(e: TensorEntry, where: str, device: torch.device | None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """A new tensor for ``e`` (on CUDA ``device`` if given) and, if read into directly, its
    page-aligned padded byte buffer."""
    try:
        dtype = dtype_from_name(e.dtype)
        if device is not None:
            return torch.empty(e.shape, dtype=dtype, device=device), None
        if e.nbytes >= max(stream.DIRECT_MIN_BYTES, PAGE_ITEM_BYTES):  # alone on its pages
            buf = aligned_empty(e.nbytes)
            return buf[:e.nbytes].view(dtype).view(e.shape), buf
        return torch.empty(e.shape, dtype=dtype), None
    except (RuntimeError, MemoryError) as exc:  # torch.OutOfMemoryError is a RuntimeError
        on = f" on {device}" if device is not None else ""
        raise bad(where, f"cannot allocate tensor {e.key!r} ({e.nbytes} bytes){on}: {exc}", e.key) from None


def file_reads(tier: Tier, man: Manifest, engine: Engine | None, dst: Any, *, needed: list[int] | None,
               only: set[str] | None, sparse: bool) -> list[FileRead]:
    """One :class:`FileRead` per file: own shards (with ``sparse`` only the ``needed`` items) and
    the earlier steps' files the needed entries live in. ``dst(i)``: ``(address or None, direct
    buffer or None, protected[, CUDA bytes])`` for entry ``i``."""
    alias = man.alias_of
    pick = set(needed) if needed is not None else None
    by_ref = {(r.step, r.name): r for r in man.ref_files}
    by_file: dict[str, list[int]] = {}
    refs: dict[RefFile, list[int]] = {}
    for i, e in enumerate(man.tensors):
        if e.step is not None:  # lives in an earlier step's file (an incremental step)
            if pick is None or i in pick:
                refs.setdefault(by_ref[(e.step, e.file)], []).append(i)
        elif i not in alias and (not sparse or pick is None or i in pick):
            by_file.setdefault(e.file, []).append(i)
    out = [file_read(tier, man.step, fe.name, fe.file_bytes,
                     ShardHeader(fe.file_id or man.checkpoint_id, man.step, fe.rank, fe.file_bytes),
                     man, by_file.get(fe.name, []), dst, engine, sparse=sparse)
           for fe in man.files if (only is None or fe.name in only) and (not sparse or fe.name in by_file)]
    return out + [file_read(tier, r.step, r.name, r.file_bytes, ShardHeader(r.file_id, r.step, r.rank, r.file_bytes),
                            man, ix, dst, engine)  # only the referenced items' extents
                  for r, ix in refs.items() if only is None or r.name in only]


def _held(bounce: Any) -> Any:
    """The shared bounce's lock if ``bounce`` is that one (a staging pool's is its caller's own)."""
    return _bounce_lock if bounce is _bounce else contextlib.nullcontext()


def read_step(files: list[FileRead], bounce: Any, io: IOConfig, *, verify: bool = True,
              gate: Callable[[], None] | None = None, slow_source: bool = False) -> Stats:
    """Read ``files`` through :mod:`.stream` with ``bounce`` as scratch: transactional for
    protected destinations, verified first when they do not fit. ``gate()`` runs once every
    byte verified, before a staged byte lands (what it raises rolls back). ``slow_source`` (a
    remote tier): a transient scratch of the step's size, if the host has it, rather than
    reading twice (docs/speed-tricks.md)."""
    global last_stats
    plan = Plan(files, io, in_place=any(fr.protect for fr in files))
    with _held(bounce):
        if plan.fits(bounce.nbytes):
            last_stats = plan.run(bounce, verify=verify, gate=gate)
            return last_stats
    # never for a local disk: new memory can fault slower than it reads the step twice
    if slow_source and plan.need_bytes() < _meminfo("MemAvailable") // 2:
        with contextlib.closing(Arena(plan.need_bytes(), mlock=False, hugepages=False, prefault=False)) as arena:
            last_stats = plan.run(arena, verify=verify, gate=gate)
            return last_stats
    head_bytes = min(int(plan.ring_bytes * HEAD_FRACTION), _meminfo("MemAvailable") // 2)
    head_bytes = head_bytes if head_bytes >= plan.w else 0  # none under one window
    log.info("zerostall: an in-place load of %d bytes does not fit in %d bytes of scratch; verifying it first "
             "(the first %d bytes under rollback in new memory, the rest read again)", plan.ring_bytes,
             bounce.nbytes, head_bytes)
    idents: dict[int, tuple[int, ...]] = {}  # the second pass reads the very files the first verified
    second: list[Stats] = []
    new = contextlib.closing(Arena(head_bytes, mlock=False, hugepages=False, prefault=False)) if head_bytes else None
    with new or contextlib.nullcontext(_NO_HEAD) as head, _held(bounce):
        last_stats = plan.run(bounce, verify=True, gate=gate, idents=idents, head=head,
                              then=lambda first: second.extend(read_later(files, first, bounce, io, verify, idents)))
    if second:  # what both passes read, and what the second delivered
        last_stats.bytes_read += second[0].bytes_read
        last_stats.device_bytes += second[0].device_bytes
    return last_stats


def read_later(files: list[FileRead], first: Stats, ring: Any, io: IOConfig, verify: bool,
               idents: dict[int, tuple[int, ...]]) -> list[Stats]:
    """A split read's second pass, inside the first's ``then``: the items past the head, read
    again from the very files, checked again, through ``ring`` into their destinations."""
    ks = [k for k in range(len(files)) if first.later.get(k)]
    if not ks:
        return []
    later = [replace(files[k], wanted=first.later[k], direct={}, protect=set()) for k in ks]
    plan = Plan(later, io, in_place=False)
    try:
        return [plan.run(ring, verify=verify, idents={j: idents[k] for j, k in enumerate(ks) if k in idents})]
    except Exception as exc:
        if plan.stats is None or not plan.stats.written_bytes:
            raise  # nothing of the state dict written: the head rolls back, it is as it was
        # the tail is written as it verifies (no memory for its old bytes): say so, never "not modified"
        reason = str(exc) if isinstance(exc, ZerostallError) else f"{type(exc).__name__}: {exc}"
        raise CorruptCheckpoint(
            f"{later[0].path}: the second read of this step (larger than the restore scratch) failed after "
            f"writing up to {plan.stats.written_bytes} bytes of the state dict ({reason}); the state dict is "
            "part loaded: load a step into it again", path=later[0].path, part_loaded=True) from exc


HEAD_FRACTION = 0.5
"""Share of an in-place load too big for the scratch read once, under rollback, into new memory
(at most half the available memory); the rest is verified first, read again (docs/speed-tricks.md)."""

_NO_HEAD: Any = SimpleNamespace(nbytes=0, u8=None)


def load_step(tier: Tier, step: int, engine: Engine, bounce: Any, state_dict: Any = None,
              request: LoadRequest | None = None, *, report: LoadReport | None = None,
              **fields: Any) -> Any:
    """Load one step as ``request`` asks (``fields`` replace some of its fields); nothing in
    ``state_dict`` changes unless every byte this load needs verified. Raises
    CorruptCheckpoint/StorageError for the checkpoint's defects, StateMismatchError for the
    caller's. ``request.gate`` (:mod:`zerostall.distributed.agree`) runs once every byte
    verified; what it raises propagates, rolled back."""
    req = replace(request or LoadRequest(), **fields)
    man = tier.read_manifest(step)
    where = shard_where(tier, step, "").rstrip("/")
    tree = man.tree_for(req.rank, req.world_size)
    if req.keys is not None:
        tree = select_keys(tree, req.keys, step)
    canon = man.alias_of
    needed = sorted({canon.get(i, i) for i, _ in tree_tensor_indices(tree)})
    only = {man.tensors[i].file for i in needed}
    check_files(tier, man, only, engine)  # before allocating anything the manifest asks for
    need_bytes = sum(man.tensors[i].nbytes for i in needed)
    host = _meminfo("MemTotal", "SwapTotal") or (1 << 62)  # no larger allocation can succeed here
    if need_bytes > host:
        raise bad(where, f"the manifest asks for {need_bytes} bytes of tensors, more than this host's RAM and "
                         f"swap ({host}); corrupt, or load it on a bigger host")

    in_place: dict[int, tuple[torch.Tensor, str]] = {}
    if state_dict is not None:
        skeleton = decode_tree(tree, [None] * len(man.tensors), where=where)
        missing, unexpected = key_report(state_dict, skeleton, req.keys)
        if req.strict and (missing or unexpected):
            raise StateMismatchError(
                f"state dict does not match step {step} (strict=True): missing keys {missing[:10]}, "
                f"unexpected keys {unexpected[:10]}")
        if report is not None:
            report.missing_keys, report.unexpected_keys = missing, unexpected
        find_in_place(state_dict, tree, in_place)
        for i, (t, key) in list(in_place.items()):
            e = man.tensors[canon.get(i, i)]
            if tuple(t.shape) != e.shape or t.dtype != dtype_from_name(e.dtype):
                raise StateMismatchError(
                    f"state dict key {key!r} is {t.dtype} {tuple(t.shape)} but the checkpoint "
                    f"(step {step}) holds {e.dtype} {list(e.shape)}; the checkpoint was saved from a "
                    "different model or configuration")
    # the caller's contiguous tensors are filled in place; the rest are new tensors (merge()
    # copies them into non-contiguous ones)
    tensors: list[Any] = [None] * len(man.tensors)
    dsts: dict[int, tuple[Any, ...]] = {}  # address, direct buffer, protected[, CUDA bytes]
    cpu = {i: d.detach() for i in needed if (d := in_place.get(i, (None,))[0]) is not None
           and d.device.type == "cpu" and d.is_contiguous()}
    gpu = {i: d.detach() for i in needed if (d := in_place.get(i, (None,))[0]) is not None
           and d.device.type == "cuda" and d.is_contiguous()} if len(cpu) < len(in_place) else {}
    shared = overlapping(cpu) | overlapping(gpu)  # one tensor at two keys that the step holds as two: merge() fills it
    target = cuda_target(req.map_location) if state_dict is None else None
    for i in needed:
        if (mine := cpu.get(i, gpu.get(i))) is not None and i not in shared:
            tensors[i] = mine
            dsts[i] = (mine.data_ptr(), None, True) + ((mine.reshape(-1).view(torch.uint8),) if i in gpu else ())
        else:
            t, direct = _new(man.tensors[i], where, target)
            tensors[i] = t
            dsts[i] = ((t.data_ptr(), None, False, t.reshape(-1).view(torch.uint8)) if target is not None else
                       (None if direct is not None else t.data_ptr(), direct, False))
    files = file_reads(tier, man, engine, lambda i: dsts.get(i, (None, None, False)), needed=needed,
                       only=only, sparse=req.keys is not None)
    read_step(files, bounce, req.io or engine.cfg, verify=req.verify, gate=req.gate,
              slow_source=not isinstance(tier, LocalTier))
    for i, j in canon.items():
        tensors[i] = tensors[j]
    if state_dict is None:
        mapper = location_mapper(req.map_location)
        done = {i: mapper(tensors[i]) for i in needed}
        return decode_tree(tree, [done.get(canon.get(i, i)) for i in range(len(tensors))], where=where)
    return merge(state_dict, decode_tree(tree, tensors, where=where))


def verify_step(tier: Tier, step: int, engine: Engine | None, bounce: Any = None, *,
                only: Callable[[Manifest], set[str] | None] | None = None) -> Manifest:
    """Read every byte of ``step`` and check it, keeping nothing; raises CorruptCheckpoint.
    ``only(manifest)``: the shard files to check (a node-local copy's own), None: all."""
    man = tier.read_manifest(step)
    names = only(man) if only is not None else None
    check_files(tier, man, names, engine)
    read_step(file_reads(tier, man, engine, lambda i: (None, None, False), needed=None, only=names, sparse=False),
              bounce or shared_bounce(), engine.cfg if engine is not None else IOConfig())
    return man


def verify_tier_step(tier: Tier, step: int, bounce: Any = None) -> Manifest:
    """:func:`verify_step` on any tier without an engine (a remote tier streams its objects;
    nothing is stored locally). Raises CorruptCheckpoint (RemoteError if it cannot be read)."""
    return verify_step(tier, step, None, bounce)
