"""Reading the referenced part of an incremental step: tensors that live in earlier steps' shards.

Called by :mod:`.step` (caller's thread), with the step's own shards, for the entries of
a manifest that carry a ``step`` (see :mod:`.format.refs`). Each referenced file goes through
the same checks as an own shard, read-only: the referenced step must be committed with a
manifest that validates and lists the file with the same size and id; the file must be a
regular file (no symlink) of the recorded size; its header must match exactly; every
referenced tensor's crc32c must match and the padding after it must be zero (the one shard
codec in its sparse mode, through the same pipeline, :mod:`.stream`). Only the referenced ranges
are read, so restoring an incremental step reads
about what restoring the same step written in full would.
A failure raises :class:`CorruptCheckpoint` naming the referenced file: the dependent step
fails verification and restore falls back to an older step.
"""

from __future__ import annotations

from typing import Any, Callable, Iterable

from ..errors import CheckpointNotFound, CorruptCheckpoint
from ..format.layout import ShardHeader
from ..format.manifest import Manifest
from ..format.refs import RefFile
from ..store.tier import Tier
from .stream import FileRead


def shard_where(tier: Tier, step: int, name: str) -> str:
    """How messages name file ``name`` of ``step`` on ``tier`` (a path for a local tier)."""
    return f"{tier.url.rstrip('/')}/step-{step}/{name}"


def check_size(tier: Tier, step: int, name: str, want: int, recorded_by: str = "manifest says") -> None:
    """Shard ``step-N/<name>`` on ``tier`` is a regular file of ``want`` bytes, else
    :class:`CorruptCheckpoint` naming it; ``recorded_by`` says who recorded that size (an
    incremental step's reference to an earlier step's file). Caller's thread, before any read."""
    path = shard_where(tier, step, name)
    size = tier.stat(f"step-{step}/{name}")
    if size is None:
        raise CorruptCheckpoint(f"{path}: shard file is missing or not a regular file ({recorded_by} {want} bytes)",
                                path=path)
    if size != want:
        raise CorruptCheckpoint(f"{path}: shard is {size} bytes, {recorded_by} {want} (truncated or replaced)", path=path)


def ref_groups(man: Manifest, indices: Iterable[int]) -> dict[RefFile, list[int]]:
    """The manifest entries ``indices`` that live in earlier steps' files, grouped by file."""
    by_key = {(r.step, r.name): r for r in man.ref_files}
    out: dict[RefFile, list[int]] = {}
    for i in indices:
        e = man.tensors[i]
        if e.step is not None:
            out.setdefault(by_key[(e.step, e.file)], []).append(i)
    return out


def check_ref_files(tier: Tier, man: Manifest, refs: list[RefFile]) -> None:
    """Each referenced file belongs to a committed step that lists it, and has its size.

    Runs before anything is allocated or read (like ``step.check_files``); the open that
    reads it refuses anything but a regular file (:meth:`Tier.open_shard_read`)."""
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
        own = {f.name: f for f in manifests[r.step].files}
        fe = own.get(r.name)
        if fe is None or fe.file_bytes != r.file_bytes or (fe.file_id or manifests[r.step].checkpoint_id) != r.file_id:
            raise CorruptCheckpoint(f"{where}, but step {r.step}'s manifest does not list that file as "
                                    "recorded (step overwritten?)", path=step_where)
        check_size(tier, r.step, r.name, r.file_bytes, f"{where} with")


def ref_reads(tier: Tier, man: Manifest, groups: dict[RefFile, list[int]],
              dst: Callable[[int], Any], engine: Any) -> list[FileRead]:
    """One sparse :class:`~.stream.FileRead` per referenced file: only the referenced items'
    extents are read (with the header); ``dst(i)`` is ``(address or None, direct buffer
    or None, protected[, CUDA bytes or None])`` for manifest entry ``i``."""
    return [file_read(tier, r.step, r.name, r.file_bytes, ShardHeader(r.file_id, r.step, r.rank, r.file_bytes),
                      man, sorted(idx, key=lambda i: man.tensors[i].offset), dst, engine)
            for r, idx in groups.items()]


def file_read(tier: Tier, step: int, name: str, file_bytes: int, header: ShardHeader, man: Manifest,
              idx: list[int], dst: Callable[[int], Any], engine: Any, *, sparse: bool = True) -> FileRead:
    """The :class:`~.stream.FileRead` of ``step-N/<name>`` for manifest entries ``idx`` (sorted
    by offset), each read into ``dst(i)`` (see :func:`ref_reads`); ``sparse``: only their
    extents are read (with the header), else the whole file."""
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
