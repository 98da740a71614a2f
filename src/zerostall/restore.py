"""Restore: find the newest committed checkpoint that verifies and load it.

Called from the caller's thread (``zerostall.load``, ``Checkpointer.load``, the CLI).
For each candidate step, newest first: read and validate the manifest (nothing is read from
a shard before it passes), open each shard without following symlinks, check its size,
then stream it with direct I/O through an aligned bounce buffer, checking the header
exactly, every tensor's crc32c and that all padding is zero, and copy each tensor's bytes
into its destination. A step that fails is logged with the file and tensor at fault, and
the previous one is tried (``fallback=True``).

Destinations: with a ``state_dict``, CPU tensors of matching shape and dtype are filled in
place (as DCP does); other tensors are copied in once verified, and missing entries are
added. If every candidate fails, in-place tensors may hold partial data and the error
says so. Without one, new tensors are returned (moved to ``map_location``).
"""

from __future__ import annotations

import logging
import os
import stat
import threading
from dataclasses import dataclass
from typing import Any

import torch

from .config import IOConfig
from .errors import CheckpointNotFound, CorruptCheckpoint, RemoteError, StorageError, ZerostallError
from .format.dtypes import dtype_from_name
from .format.layout import ShardHeader
from .format.manifest import Manifest, TensorEntry
from .format.shard import read_shard
from .format.tree import decode_tree, tree_tensor_indices
from .io.base import Engine, choose_engine
from .staging.arena import Arena
from .store.local import LocalTier

log = logging.getLogger("zerostall")

BOUNCE_BYTES = 128 << 20
_bounce_lock = threading.Lock()
_bounce: Arena | None = None


def _shared_bounce() -> Arena:
    global _bounce
    if _bounce is None:
        _bounce = Arena(BOUNCE_BYTES, mlock=False)
    return _bounce


@dataclass
class _Target:
    entry: TensorEntry
    tensor: torch.Tensor | None  # contiguous CPU tensor the bytes land in; None: verify only
    in_place: bool


def _flat(t: torch.Tensor) -> torch.Tensor:
    return t.reshape(-1).view(torch.uint8)


def check_files(tier: LocalTier, man: Manifest, only: set[str] | None = None) -> None:
    """Every shard exists, is a regular file (no symlink) and has the recorded size.

    Runs before anything is allocated or read, so a hostile manifest cannot make us
    allocate what the files do not hold.
    """
    step_dir = tier.step_dir(man.step)
    for fe in man.files:
        if only is not None and fe.name not in only:
            continue
        path = os.path.join(step_dir, fe.name)
        try:
            st = os.lstat(path)
        except FileNotFoundError:
            raise CorruptCheckpoint(f"{path}: shard file is missing", path=path) from None
        if stat.S_ISLNK(st.st_mode) or not stat.S_ISREG(st.st_mode):
            raise CorruptCheckpoint(f"{path}: shard is not a regular file (symlink?)", path=path)
        if st.st_size != fe.file_bytes:
            raise CorruptCheckpoint(f"{path}: shard is {st.st_size} bytes, manifest says "
                                    f"{fe.file_bytes} (truncated or replaced)", path=path)


def read_checkpoint(tier: LocalTier, man: Manifest, engine: Engine, bounce: Arena,
                    targets: list[_Target], *, verify: bool = True, only: set[str] | None = None,
                    files_checked: bool = False) -> None:
    """Stream the shards of ``man`` (all, or the files in ``only``) into ``targets``
    (index-aligned with ``man.tensors``; a target without a tensor is verified only)."""
    if not files_checked:
        check_files(tier, man, only)
    step_dir = tier.step_dir(man.step)
    by_file: dict[str, list[int]] = {}
    for i, t in enumerate(man.tensors):
        by_file.setdefault(t.file, []).append(i)
    for fe in man.files:
        if only is not None and fe.name not in only:
            continue
        path = os.path.join(step_dir, fe.name)
        header = ShardHeader(fe.file_id or man.checkpoint_id, man.step, fe.rank, fe.file_bytes)
        items = sorted(by_file.get(fe.name, []), key=lambda i: man.tensors[i].offset)
        try:
            f = engine.open_read(path)
        except StorageError as exc:
            raise CorruptCheckpoint(f"{path}: cannot open shard: {exc}", path=path) from exc
        with f:
            _stream_file(f, path, fe.file_bytes, header, [targets[i] for i in items], bounce, verify)


def _stream_file(f: Any, path: str, file_bytes: int, header: ShardHeader, targets: list[_Target],
                 bounce: Arena, verify: bool) -> None:
    """Every byte checked by the one shard codec (:func:`zerostall.format.shard.read_shard`)."""
    read_shard(f, path, file_bytes, header, [t.entry for t in targets],
               [_flat(t.tensor) if t.tensor is not None else None for t in targets], bounce, verify=verify)


def _find_in_place(dest: Any, node: Any, out: dict[int, Any], path: str = "") -> None:
    """Map manifest tensor indices to the caller's tensors at the same key path."""
    if not isinstance(node, dict) or len(node) != 1:
        return
    (tag, val), = node.items()
    if tag == "T" and isinstance(dest, torch.Tensor):
        out[val] = (dest, path)
    elif tag == "d" and isinstance(dest, dict):
        for k_node, v_node in val:
            k = _key(k_node)
            if k in dest:
                _find_in_place(dest[k], v_node, out, f"{path}.{k}" if path else str(k))
    elif tag in ("l", "t") and isinstance(dest, (list, tuple)) and len(dest) == len(val):
        for i, (d, n) in enumerate(zip(dest, val)):
            _find_in_place(d, n, out, f"{path}.{i}" if path else str(i))


def _key(k_node: Any) -> Any:
    return decode_tree({"d": [[k_node, {"v": None}]]}, []).popitem()[0]


def _merge(dest: Any, restored: Any) -> Any:
    """Copy ``restored`` into ``dest`` where both are containers/tensors; return the result."""
    if isinstance(dest, dict) and isinstance(restored, dict):
        for k, v in restored.items():
            dest[k] = _merge(dest[k], v) if k in dest else v
        return dest
    if isinstance(dest, list) and isinstance(restored, list) and len(dest) == len(restored):
        for i, v in enumerate(restored):
            dest[i] = _merge(dest[i], v)
        return dest
    if isinstance(dest, torch.Tensor) and isinstance(restored, torch.Tensor):
        if dest is restored:
            return dest
        if dest.shape != restored.shape or dest.dtype != restored.dtype:
            raise ZerostallError(
                f"cannot load a {restored.dtype} tensor of shape {tuple(restored.shape)} into the "
                f"state dict's {dest.dtype} tensor of shape {tuple(dest.shape)} (same key); "
                "the checkpoint was saved from a different model or configuration")
        with torch.no_grad():
            dest.copy_(restored)
        return dest
    return restored


def load_step(tier: LocalTier, step: int, engine: Engine, bounce: Arena, state_dict: Any = None,
              map_location: Any = None, verify: bool = True, rank: int = 0, world_size: int = 1) -> Any:
    man = tier.read_manifest(step)
    tree = man.tree_for(rank, world_size)
    needed = {i for i, _ in tree_tensor_indices(tree)}
    only = {man.tensors[i].file for i in needed}
    check_files(tier, man, only)  # before allocating anything the manifest asks for
    in_place: dict[int, Any] = {}
    if state_dict is not None:
        _find_in_place(state_dict, tree, in_place)
    targets: list[_Target] = []
    for i, e in enumerate(man.tensors):
        if i not in needed:
            targets.append(_Target(e, None, False))
            continue
        dtype = dtype_from_name(e.dtype)
        d = in_place.get(i)
        if d is not None:
            t, key = d
            if tuple(t.shape) != e.shape or t.dtype != dtype:
                raise ZerostallError(
                    f"state dict key {key!r} is {t.dtype} {tuple(t.shape)} but the checkpoint "
                    f"(step {step}) holds {e.dtype} {list(e.shape)}; the checkpoint was saved from a "
                    "different model or configuration")
            if t.device.type == "cpu" and t.is_contiguous():
                targets.append(_Target(e, t.detach(), True))
                continue
        targets.append(_Target(e, torch.empty(e.shape, dtype=dtype), False))
    with _bounce_lock if bounce is _bounce else _nolock():
        read_checkpoint(tier, man, engine, bounce, targets, verify=verify, only=only,
                        files_checked=True)
    tensors: list[Any] = [t.tensor for t in targets]
    if map_location is not None and state_dict is None:
        tensors = [t.to(map_location) if t is not None else None for t in tensors]
    restored = decode_tree(tree, tensors, where=tier.step_dir(step))
    if state_dict is None:
        return restored
    return _merge(state_dict, restored)


def verify_step(tier: LocalTier, step: int, engine: Engine, bounce: Arena | None = None) -> Manifest:
    """Read every byte of ``step`` and check it, keeping nothing; raises CorruptCheckpoint."""
    man = tier.read_manifest(step)
    bounce = bounce or _shared_bounce()
    with _bounce_lock if bounce is _bounce else _nolock():
        read_checkpoint(tier, man, engine, bounce, [_Target(e, None, False) for e in man.tensors])
    return man


class _nolock:
    def __enter__(self) -> None: ...
    def __exit__(self, *a: object) -> None: ...


def fetch_remote_step(tier: LocalTier, remote: Any, step: int) -> Manifest:
    """Download ``step`` from ``remote`` into the local tier (direct I/O) and commit it there."""
    man = Manifest.from_bytes(remote.read_manifest_bytes(step), where=f"{remote.url}/step-{step}/manifest.json")
    if man.step != step:
        raise CorruptCheckpoint(f"{remote.url}/step-{step}: manifest says step {man.step}")
    os.makedirs(tier.root, exist_ok=True)
    part = tier.begin(step)
    try:
        for fe in man.files:
            remote.download(f"step-{step}/{fe.name}", os.path.join(part, fe.name), fe.file_bytes)
    except BaseException:
        tier.abort(step)
        raise
    tier.commit(step, man, overwrite=True)
    log.info("zerostall: fetched step %d from %s into %s", step, remote.url, tier.root)
    return man


def load(path: str, state_dict: Any = None, step: int | None = None, map_location: Any = None, *,
         verify: bool = True, fallback: bool = True, engine: Engine | None = None,
         bounce: Arena | None = None, io: IOConfig | None = None, rank: int = 0, world_size: int = 1,
         remote: Any = None) -> Any:
    """Load the newest verified checkpoint (or ``step``) under ``path``; see the module doc.

    With ``remote`` (a URL or tier), steps only the remote holds are downloaded into ``path``
    first; for each step, newest first, the local copy is tried, then the remote one. A remote
    that cannot be listed within a few seconds (down, unreachable) is skipped with a warning:
    local checkpoints load as if there were no remote tier.
    """
    remote_why = ""
    remote_steps: list[int] = []
    if remote is not None:
        from .store.remote import list_steps, open_tier
        if isinstance(remote, str):
            remote = open_tier(remote, io=io)
        listed, remote_why = list_steps(remote)
        remote_steps = listed or []
    tier = LocalTier(path, create=remote is not None)
    steps = tier.listed_steps()  # damaged ones too: each is tried and its defect reported
    every = sorted(set(steps) | set(remote_steps))
    if not every:
        extra = f" ({len(tier.partial_steps())} unfinished .partial directories)" if tier.partial_steps() else ""
        if remote_why:
            raise RemoteError(f"no committed checkpoint in {tier.root!r}, and the remote tier could not be listed: "
                              f"{remote_why}", url=remote.url)
        where = f"{tier.root!r}" + (f" or {remote.url}" if remote is not None else "")
        raise CheckpointNotFound(f"no committed checkpoint in {where}{extra}")
    if step is not None:
        if step not in every:
            raise CheckpointNotFound(f"no committed checkpoint for step {step} in {tier.root!r} "
                                     f"(steps: {every})")
        candidates = [step]
    else:
        candidates = list(reversed(every)) if fallback else [every[-1]]
    own_engine = engine is None
    if engine is None:
        engine = choose_engine(tier.root, io or IOConfig())
    bounce = bounce or _shared_bounce()
    errors: list[str] = []
    try:
        for s in candidates:
            sources = (["local"] if s in steps else []) + (["remote"] if s in remote_steps else [])
            for src in sources:
                try:
                    if src == "remote":
                        fetch_remote_step(tier, remote, s)
                    out = load_step(tier, s, engine, bounce, state_dict, map_location, verify, rank, world_size)
                    if errors:
                        log.warning("zerostall: loaded step %d (%s) after newer copies failed: %s", s, src,
                                    "; ".join(errors))
                    return out
                except (CorruptCheckpoint, StorageError) as exc:
                    log.error("zerostall: step %d (%s copy) failed: %s", s, src, exc)
                    errors.append(f"step {s} ({src}): {exc}")
                    if src == "remote":
                        tier.delete(s)  # drop the bad download
        partial = " The state dict may be partially overwritten." if state_dict is not None else ""
        raise CorruptCheckpoint(f"no checkpoint in {tier.root!r} verifies: " + "; ".join(errors) + partial,
                                path=tier.root)
    finally:
        if own_engine:
            engine.close()
