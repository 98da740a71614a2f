"""Reading the referenced part of an incremental step: tensors that live in earlier steps' shards.

Called by :mod:`.restore` (caller's thread), after the step's own shards, for the entries of
a manifest that carry a ``step`` (see :mod:`.format.refs`). Each referenced file goes through
the same checks as an own shard, read-only: the referenced step must be committed with a
manifest that validates and lists the file with the same size and id; the file must be a
regular file (no symlink) of the recorded size; its header must match exactly; every
referenced tensor's crc32c must match and the padding after it must be zero (the one shard
codec, :func:`.format.shard.read_shard`, in its sparse mode). Only the referenced ranges are
read (coalesced into windows of the bounce buffer), so restoring an incremental step reads
about what restoring the same step written in full would.
A failure raises :class:`CorruptCheckpoint` naming the referenced file: the dependent step
fails verification and restore falls back to an older step.
"""

from __future__ import annotations

import os
import stat
from typing import Any, Callable

import torch

from ..errors import CheckpointNotFound, CorruptCheckpoint
from ..format.layout import ShardHeader
from ..format.manifest import Manifest
from ..format.refs import RefFile
from ..format.shard import read_shard


def ref_groups(man: Manifest, targets: list[Any]) -> dict[RefFile, list[Any]]:
    """The targets of referenced entries, grouped by the file they live in."""
    by_key = {(r.step, r.name): r for r in man.ref_files}
    out: dict[RefFile, list[Any]] = {}
    for t in targets:
        if t.entry.step is not None:
            out.setdefault(by_key[(t.entry.step, t.entry.file)], []).append(t)
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


def read_refs(tier: Any, groups: dict[RefFile, list[Any]], open_shard: Callable[[str], Any], bounce: Any,
              verify: bool = True) -> None:
    """Read (and check) every referenced target of ``groups``; ``open_shard(path)`` opens a
    regular file read-only through the engine (``restore._open_shard``)."""
    for r, targets in groups.items():
        path = os.path.join(tier.step_dir(r.step), r.name)
        items = sorted(targets, key=lambda t: t.entry.offset)
        with open_shard(path) as f:
            read_shard(f, path, r.file_bytes, ShardHeader(r.file_id, r.step, r.rank, r.file_bytes),
                       [t.entry for t in items],
                       [t.tensor.reshape(-1).view(torch.uint8) if t.tensor is not None else None for t in items],
                       bounce, verify=verify, wanted=set(range(len(items))))


def verify_tier_refs(tier: Any, man: Manifest, bounce: Any) -> None:
    """``verify`` of a step on any tier (``restore.verify_tier_step``): the referenced bytes,
    read through the tier's ``open_shard_read`` like its own shards."""
    by_key = {(r.step, r.name): r for r in man.ref_files}
    groups: dict[RefFile, list[Any]] = {}
    for e in man.tensors:
        if e.step is not None:
            groups.setdefault(by_key[(e.step, e.file)], []).append(e)
    base = getattr(tier, "url", getattr(tier, "root", "")).rstrip("/")
    for r, entries in groups.items():
        where = f"{base}/step-{r.step}/{r.name}"
        try:
            theirs = tier.read_manifest(r.step)
        except CheckpointNotFound:
            raise CorruptCheckpoint(f"step {man.step} references {where}, but step {r.step} is not a "
                                    "committed checkpoint there (deleted?)", path=where) from None
        fe = {f.name: f for f in theirs.files}.get(r.name)
        if fe is None or fe.file_bytes != r.file_bytes or (fe.file_id or theirs.checkpoint_id) != r.file_id:
            raise CorruptCheckpoint(f"step {man.step} references {where}, but step {r.step}'s manifest does not "
                                    "list that file as recorded (step overwritten?)", path=where)
        size = tier.stat(f"step-{r.step}/{r.name}") if hasattr(tier, "stat") else r.file_bytes
        if size != r.file_bytes:
            raise CorruptCheckpoint(f"{where}: referenced shard is {size} bytes, step {man.step} says "
                                    f"{r.file_bytes}", path=where)
        entries.sort(key=lambda e: e.offset)
        with tier.open_shard_read(r.step, r.name) as f:
            read_shard(f, where, r.file_bytes, ShardHeader(r.file_id, r.step, r.rank, r.file_bytes), entries,
                       [None] * len(entries), bounce, verify=True, wanted=set(range(len(entries))))
