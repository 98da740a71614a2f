"""Reading the referenced part of an incremental step: tensors that live in earlier steps' shards.

Called by :mod:`.restore` (caller's thread), after the step's own shards, for the entries of
a manifest that carry a ``step`` (see :mod:`.format.refs`). Each referenced file goes through
the same checks as an own shard, read-only: the referenced step must be committed with a
manifest that validates and lists the file with the same size and id; the file must be a
regular file (no symlink) of the recorded size; its header must match exactly; every
referenced tensor's crc32c must match and the padding after it must be zero. Only the
referenced ranges are read (coalesced into windows of the bounce buffer), so restoring an
incremental step reads about what restoring the same step written in full would.
A failure raises :class:`CorruptCheckpoint` naming the referenced file: the dependent step
fails verification and restore falls back to an older step.
"""

from __future__ import annotations

import os
import stat
from typing import Any

import crc32c as _crc
import torch

from .config import ALIGN_BYTES
from .errors import CheckpointNotFound, CorruptCheckpoint, StorageError
from .format.layout import HEADER_BYTES, ShardHeader, align_up
from .format.manifest import Manifest
from .format.refs import RefFile


def ref_groups(man: Manifest, targets: list[Any], needed: set[int] | None = None) -> dict[RefFile, list[Any]]:
    """Targets of referenced entries, grouped by the file they live in (``needed``: indices)."""
    by_key = {(r.step, r.name): r for r in man.ref_files}
    out: dict[RefFile, list[Any]] = {}
    for i, e in enumerate(man.tensors):
        if e.step is not None and (needed is None or i in needed):
            out.setdefault(by_key[(e.step, e.file)], []).append(targets[i])
    return out


def check_ref_files(tier: Any, man: Manifest, refs: list[RefFile]) -> None:
    """Each referenced file belongs to a committed step that lists it, and has its size.

    Runs before anything is allocated or read (like ``restore.check_files``)."""
    manifests: dict[int, Manifest] = {}
    for r in refs:
        where = f"step {man.step} references step-{r.step}/{r.name}"
        if r.step not in manifests:
            try:
                manifests[r.step] = tier.read_manifest(r.step)
            except CheckpointNotFound:
                raise CorruptCheckpoint(f"{where}, but step {r.step} is not a committed checkpoint in "
                                        f"{tier.root!r} (deleted?)", path=tier.step_dir(r.step)) from None
        own = {f.name: f for f in manifests[r.step].files}
        fe = own.get(r.name)
        if fe is None or fe.file_bytes != r.file_bytes or (fe.file_id or manifests[r.step].checkpoint_id) != r.file_id:
            raise CorruptCheckpoint(f"{where}, but step {r.step}'s manifest does not list that file as "
                                    "recorded (step overwritten?)", path=tier.step_dir(r.step))
        path = os.path.join(tier.step_dir(r.step), r.name)
        try:
            st = os.lstat(path)
        except FileNotFoundError:
            raise CorruptCheckpoint(f"{path}: referenced shard file is missing ({where})", path=path) from None
        if stat.S_ISLNK(st.st_mode) or not stat.S_ISREG(st.st_mode):
            raise CorruptCheckpoint(f"{path}: referenced shard is not a regular file (symlink?)", path=path)
        if st.st_size != r.file_bytes:
            raise CorruptCheckpoint(f"{path}: referenced shard is {st.st_size} bytes, {where} with "
                                    f"{r.file_bytes} (truncated or replaced)", path=path)


def read_refs(tier: Any, man: Manifest, engine: Any, bounce: Any, groups: dict[RefFile, list[Any]],
              verify: bool = True) -> None:
    """Read (and check) every referenced tensor of ``groups`` into its target."""
    for r, targets in groups.items():
        path = os.path.join(tier.step_dir(r.step), r.name)
        try:
            f = engine.open_read(path)
        except StorageError as exc:
            raise CorruptCheckpoint(f"{path}: cannot open referenced shard: {exc}", path=path) from exc
        with f:
            _read_ranges(f, path, ShardHeader(r.file_id, r.step, r.rank, r.file_bytes),
                         sorted(targets, key=lambda t: t.entry.offset), bounce, verify)


def _windows(targets: list[Any], win: int) -> list[tuple[int, int]]:
    """Aligned [a, b) reads covering each target's payload and padding, merged, cut at ``win``."""
    spans: list[list[int]] = []
    for t in targets:
        a, b = t.entry.offset, align_up(t.entry.offset + t.entry.nbytes)
        if a == b:
            continue
        if spans and a <= spans[-1][1]:
            spans[-1][1] = max(spans[-1][1], b)
        else:
            spans.append([a, b])
    return [(p, min(p + win, b)) for a, b in spans for p in range(a, b, win)]


def _read_ranges(f: Any, path: str, header: ShardHeader, targets: list[Any], bounce: Any, verify: bool) -> None:
    if verify:
        f.read([(0, bounce.mv[:HEADER_BYTES])])
        ShardHeader.check(bounce.mv[:HEADER_BYTES], header, path)
    win = bounce.nbytes // ALIGN_BYTES * ALIGN_BYTES
    crcs = [0] * len(targets)
    first = 0
    for w0, w1 in _windows(targets, win):
        f.read([(w0, bounce.mv[:w1 - w0])])
        j = first
        while j < len(targets):
            e = targets[j].entry
            if e.offset >= w1:
                break
            end, pad_end = e.offset + e.nbytes, align_up(e.offset + e.nbytes)
            if pad_end <= w0:
                j += 1
                continue
            a, b = max(e.offset, w0), min(end, w1)
            if a < b:
                dst = targets[j].tensor
                if dst is not None:
                    dst.reshape(-1).view(torch.uint8)[a - e.offset:b - e.offset].copy_(bounce.u8[a - w0:b - w0])
                if verify:
                    crcs[j] = _crc.crc32c(bounce.mv[a - w0:b - w0], crcs[j])
            pa, pb = max(end, w0), min(pad_end, w1)
            if verify and pa < pb and bounce.u8[pa - w0:pb - w0].any():
                raise CorruptCheckpoint(f"{path}: non-zero padding after referenced tensor {e.key!r}",
                                        path=path, key=e.key)
            if pad_end <= w1 and j == first:
                first = j + 1
            j += 1
    if verify:
        for t, c in zip(targets, crcs):
            if c != t.entry.crc32c:
                raise CorruptCheckpoint(
                    f"{path}: referenced tensor {t.entry.key!r} failed its crc32c check (recorded "
                    f"{t.entry.crc32c:08x}, read {c:08x})", path=path, key=t.entry.key)
