"""Restore: find the newest committed checkpoint that verifies and load it.

Called from the caller's thread (``zerostall.load``, ``Checkpointer.load``, the CLI).
For each candidate step, newest first: read and validate the manifest (nothing is read from
a shard before it passes), open each shard without following symlinks, check its size,
then stream it with direct I/O through an aligned bounce buffer, checking the header
exactly, every tensor's crc32c and that all padding is zero, and copy each tensor's bytes
into its destination. A step that fails is logged with the file and tensor at fault, and
the previous one is tried (``fallback=True``).

Every defect of a checkpoint falls back (manifest, files, allocation, bytes), never one of
the caller's (:class:`StateMismatchError`, :class:`ConfigError`). A step that disappears while
it is read (a writer's retention) is not a failure: the listing is read again.

Destinations: with a ``state_dict``, tensors of matching shape and dtype are filled in place
(as DCP does), transactionally: bytes land in scratch tensors (or, when those would not fit
in memory, a verify-only pass runs first) and reach the caller's tensors only once the whole
step verified, so a fallback never leaves a failed step's bytes behind. Missing and
unexpected keys are reported (``strict=True`` raises). Without one, new tensors are
returned (moved to ``map_location``). ``keys=[...]`` reads only those keys' bytes.
"""

from __future__ import annotations

import errno
import logging
import os
import threading
from dataclasses import dataclass
from typing import Any

import torch

from ..config import IOConfig
from ..errors import (CheckpointNotFound, ConfigError, CorruptCheckpoint, RemoteError, StateMismatchError,
                     StorageError, ZerostallError, storage_error)
from ..format.dtypes import dtype_from_name
from ..format.layout import ShardHeader
from ..format.manifest import Manifest, TensorEntry
from ..format.shard import read_shard
from ..format.tree import decode_tree, tree_tensor_indices
from ..format.validate import open_regular
from ..io.base import Engine, choose_engine
from ..staging.arena import Arena
from .retry import GONE, MAX_REPLACED, REPLACED, changed_under, listed_ident, remote_changed_under
from .state import LoadReport, find_in_place, key_report, location_mapper, merge, select_keys
from ..store.local import LocalTier
from ..store.owner import StepLock

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
    """Every shard exists, is a regular file (no symlink, FIFO, device or directory) and has the
    recorded size. Runs before anything is allocated or read, so a hostile manifest cannot make
    us allocate what the files do not hold, and an odd file cannot block the open."""
    step_dir = tier.step_dir(man.step)
    for fe in man.files:
        if only is not None and fe.name not in only:
            continue
        path = os.path.join(step_dir, fe.name)
        try:
            fd = open_regular(path)
        except FileNotFoundError:
            raise CorruptCheckpoint(f"{path}: shard file is missing", path=path) from None
        try:
            size = os.fstat(fd).st_size
        finally:
            os.close(fd)
        if size != fe.file_bytes:
            raise CorruptCheckpoint(f"{path}: shard is {size} bytes, manifest says "
                                    f"{fe.file_bytes} (truncated or replaced)", path=path)
    if man.ref_files:  # files of earlier steps this (incremental) step borrows from
        from .refs import check_ref_files
        check_ref_files(tier, man, [r for r in man.ref_files if only is None or r.name in only])


def _open_shard(engine: Engine, path: str) -> Any:
    """The engine's reader for ``path``, refusing anything but the regular file we checked."""
    try:
        fd = open_regular(path)
    except FileNotFoundError:
        raise CorruptCheckpoint(f"{path}: shard file is missing", path=path) from None
    try:
        st = os.fstat(fd)
        try:
            f = engine.open_read(path)
        except StorageError as exc:
            raise CorruptCheckpoint(f"{path}: cannot open shard: {exc}", path=path) from exc
        fno = getattr(f, "fd", None)
        st2 = os.fstat(fno) if isinstance(fno, int) else st
        if (st2.st_dev, st2.st_ino) != (st.st_dev, st.st_ino):
            f.close()
            raise CorruptCheckpoint(f"{path}: the shard was replaced while it was being opened", path=path)
        return f
    finally:
        os.close(fd)


def read_checkpoint(tier: LocalTier, man: Manifest, engine: Engine, bounce: Arena,
                    targets: list[_Target], *, verify: bool = True, only: set[str] | None = None,
                    files_checked: bool = False, sparse: bool = False) -> None:
    """Stream the shards of ``man`` (all, or the files in ``only``) into ``targets``.

    ``targets``: one per entry to read (a target without a tensor is verified only), disjoint.
    Without ``sparse`` every byte of each file is read and checked (header, payloads, padding);
    with it only the header and the targets' blocks. Every file is opened before any byte
    lands in a target.
    """
    if not files_checked:
        check_files(tier, man, only)
    step_dir = tier.step_dir(man.step)
    by_file: dict[str, list[_Target]] = {}
    for t in targets:
        if t.entry.step is None:  # own bytes; references (incremental saves) are read below
            by_file.setdefault(t.entry.file, []).append(t)
    opened = []
    try:
        for fe in man.files:
            if (only is not None and fe.name not in only) or (sparse and fe.name not in by_file):
                continue
            path = os.path.join(step_dir, fe.name)
            opened.append((fe, path, _open_shard(engine, path)))
        for fe, path, f in opened:
            header = ShardHeader(fe.file_id or man.checkpoint_id, man.step, fe.rank, fe.file_bytes)
            items = sorted(by_file.get(fe.name, []), key=lambda t: t.entry.offset)
            _stream_file(f, path, fe.file_bytes, header, items, bounce, verify, sparse)
    finally:
        for _, _, f in opened:
            f.close()
    if man.ref_files:
        from .refs import read_refs, ref_groups
        groups = ref_groups(man, targets)
        if only is not None:
            groups = {r: ts for r, ts in groups.items() if r.name in only}
        read_refs(tier, groups, lambda path: _open_shard(engine, path), bounce, verify)


def _stream_file(f: Any, path: str, file_bytes: int, header: ShardHeader, targets: list[_Target],
                 bounce: Arena, verify: bool, sparse: bool = False) -> None:
    """Every byte checked by the one shard codec (:func:`zerostall.format.shard.read_shard`);
    with ``sparse`` only the header and the targets' own blocks are read."""
    read_shard(f, path, file_bytes, header, [t.entry for t in targets],
               [_flat(t.tensor) if t.tensor is not None else None for t in targets], bounce, verify=verify,
               wanted=set(range(len(targets))) if sparse else None)


def _host_memory_bytes() -> int:
    """RAM + swap: no allocation larger than this can ever succeed on this host."""
    total = 0
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith(("MemTotal:", "SwapTotal:")):
                    total += int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return 1 << 62
    return total or (1 << 62)


def _mem_available_bytes() -> int:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return 1 << 30


def _empty(e: TensorEntry, where: str) -> torch.Tensor:
    try:
        return torch.empty(e.shape, dtype=dtype_from_name(e.dtype))
    except (RuntimeError, MemoryError) as exc:
        raise CorruptCheckpoint(f"{where}: cannot allocate tensor {e.key!r} ({e.nbytes} bytes): {exc}",
                                path=where, key=e.key) from None


def load_step(tier: LocalTier, step: int, engine: Engine, bounce: Arena, state_dict: Any = None,
              map_location: Any = None, verify: bool = True, rank: int = 0, world_size: int = 1, *,
              keys: list[str] | None = None, strict: bool = False,
              report: LoadReport | None = None) -> Any:
    """Load one step, transactionally: nothing in ``state_dict`` changes unless the whole step
    (every byte this load needs) verified. Raises CorruptCheckpoint/StorageError for the
    checkpoint's defects and StateMismatchError for the caller's."""
    man = tier.read_manifest(step)
    where = tier.step_dir(step)
    tree = man.tree_for(rank, world_size)
    if keys is not None:
        tree = select_keys(tree, keys, step)
    canon = man.alias_of
    needed = sorted({canon.get(i, i) for i, _ in tree_tensor_indices(tree)})
    only = {man.tensors[i].file for i in needed}
    check_files(tier, man, only)  # before allocating anything the manifest asks for
    need_bytes = sum(man.tensors[i].nbytes for i in needed)
    host = _host_memory_bytes()
    if need_bytes > host:
        raise CorruptCheckpoint(f"{where}: the manifest asks for {need_bytes} bytes of tensors, more than this "
                                f"host's RAM and swap ({host}); corrupt, or load it on a bigger host", path=where)

    in_place: dict[int, tuple[torch.Tensor, str]] = {}
    if state_dict is not None:
        skeleton = decode_tree(tree, [None] * len(man.tensors), where=where)
        missing, unexpected = key_report(state_dict, skeleton, keys)
        if strict and (missing or unexpected):
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
    # In-place destinations are written only after every byte verified: into scratch tensors
    # copied over at the end, or (when scratch would not fit) after a verify-only pass.
    direct_ok = [i for i in needed if i in in_place and in_place[i][0].device.type == "cpu"
                 and in_place[i][0].is_contiguous()]
    two_pass = verify and sum(man.tensors[i].nbytes for i in direct_ok) > _mem_available_bytes() // 4
    tensors: list[Any] = [None] * len(man.tensors)
    for i in needed:
        if two_pass and i in direct_ok:
            tensors[i] = in_place[i][0].detach()
        else:
            tensors[i] = _empty(man.tensors[i], where)
    sparse = keys is not None
    with _bounce_lock if bounce is _bounce else _nolock():
        if two_pass:
            read_checkpoint(tier, man, engine, bounce, _targets(man, needed, None, sparse), verify=True,
                            only=only, files_checked=True, sparse=sparse)
        read_checkpoint(tier, man, engine, bounce, _targets(man, needed, tensors, sparse),
                        verify=verify, only=only, files_checked=True, sparse=sparse)
    for i, j in canon.items():
        tensors[i] = tensors[j]
    if state_dict is None:
        mapper = location_mapper(map_location)
        done: dict[int, Any] = {}
        for i in needed:
            done[i] = mapper(tensors[i])
        tensors = [done.get(canon.get(i, i)) for i in range(len(tensors))]
        return decode_tree(tree, tensors, where=where)
    restored = decode_tree(tree, tensors, where=where)
    return merge(state_dict, restored)


def _targets(man: Manifest, needed: list[int], tensors: list[Any] | None, sparse: bool) -> list[_Target]:
    want = set(needed)
    if sparse:
        return [_Target(man.tensors[i], tensors[i] if tensors else None, False) for i in needed]
    return [_Target(e, tensors[i] if tensors is not None and i in want else None, False)
            for i, e in enumerate(man.tensors) if i not in man.alias_of]


def verify_step(tier: LocalTier, step: int, engine: Engine, bounce: Arena | None = None) -> Manifest:
    """Read every byte of ``step`` and check it, keeping nothing; raises CorruptCheckpoint."""
    man = tier.read_manifest(step)
    bounce = bounce or _shared_bounce()
    with _bounce_lock if bounce is _bounce else _nolock():
        read_checkpoint(tier, man, engine, bounce, _targets(man, [], None, False))
    return man


class _nolock:
    def __enter__(self) -> None: ...
    def __exit__(self, *a: object) -> None: ...


def _damaged_local_ref(tier: LocalTier, step: int, exc: BaseException) -> int | None:
    """The earlier step whose local file ``exc`` (loading ``step``) names, if ``step`` borrows from it."""
    where = getattr(exc, "path", None)
    if not isinstance(exc, CorruptCheckpoint) or not where:
        return None
    parent = os.path.basename(os.path.dirname(os.path.abspath(where)))
    if os.path.dirname(os.path.dirname(os.path.abspath(where))) != tier.root or not parent.startswith("step-"):
        return None
    try:
        ref = int(parent[len("step-"):])
        return ref if ref != step and ref in {r.step for r in tier.read_manifest(step).ref_files} else None
    except (ValueError, ZerostallError, OSError):
        return None


FETCH_LOCK_NAME = ".zerostall.fetch.lock"


class _FetchLock:
    """An exclusive ``flock`` on ``<root>/.zerostall.fetch.lock`` while one process downloads
    a step into ``root``: the ranks of a node restoring into one directory at once take turns
    (each used to remove the others' ``.partial`` and swap their commits away). Separate from
    the owner's root lock, which a training run holds for its lifetime."""

    def __init__(self, root: str):
        self.path = os.path.join(root, FETCH_LOCK_NAME)
        self.fd = -1

    def __enter__(self) -> "_FetchLock":
        import fcntl
        import stat
        try:
            self.fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC | os.O_NOFOLLOW | os.O_NONBLOCK, 0o644)
            if not stat.S_ISREG(os.fstat(self.fd).st_mode):
                raise StorageError(f"{self.path!r} is not a regular file; remove it and try again", filename=self.path)
            fcntl.flock(self.fd, fcntl.LOCK_EX)
        except OSError as exc:
            if self.fd >= 0:
                os.close(self.fd)
                self.fd = -1
            if isinstance(exc, StorageError):
                raise
            if exc.errno not in (errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS, errno.EINVAL):
                raise storage_error("locking", self.path, exc) from exc
            log.warning("zerostall: %s does not support flock: concurrent restores into it may collide",
                        os.path.dirname(self.path))
        return self

    def __exit__(self, *exc: object) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1


_ANY = object()


def fetch_remote_step(tier: LocalTier, remote: Any, step: int, seen: Any = _ANY) -> Manifest:
    """Download ``step`` from ``remote`` into the local tier (direct I/O) and commit it there
    (replacing a local copy; the steps it borrows from are fetched first if missing locally)."""
    return _fetch(tier, remote, step, seen)[0]


def _fetch(tier: LocalTier, remote: Any, step: int, seen: Any = _ANY) -> tuple[Manifest, bool]:
    """:func:`fetch_remote_step`; also says whether this call downloaded it (False: another
    process committed the same checkpoint locally since the caller saw ``seen``, the identity
    of the local manifest the caller found missing (None) or damaged; ``_ANY``: always download).
    One process at a time downloads into a root (:class:`_FetchLock`)."""
    man = remote.read_manifest(step)  # validated; names this step
    os.makedirs(tier.root, exist_ok=True)
    for ref in sorted({r.step for r in man.ref_files}):  # an incremental step: what it borrows, first
        if ref not in tier.steps():
            _fetch(tier, remote, ref, None)
    with _FetchLock(tier.root):
        now = tier.manifest_ident(step)
        if seen is not _ANY and now is not None and now != seen:
            try:
                if tier.read_manifest(step).checkpoint_id == man.checkpoint_id:
                    log.info("zerostall: step %d was fetched into %s by another process", step, tier.root)
                    return man, False
            except ZerostallError:
                pass
        staging = StepLock(tier.root, step)  # the owner's start-up cleanup leaves our .partial alone
        staging.acquire()
        try:
            _download(tier, remote, step, man)
        finally:
            staging.release(unlink=True)
    log.info("zerostall: fetched step %d from %s into %s", step, remote.url, tier.root)
    return man, True


def _download(tier: LocalTier, remote: Any, step: int, man: Manifest) -> None:
    """Download ``step``'s files into its ``.partial`` and commit it (caller holds the locks)."""
    part = tier.begin(step)
    try:
        for fe in man.files:
            rel = f"step-{step}/{fe.name}"
            size = remote.stat(rel)
            if size != fe.file_bytes:
                where = remote.where(rel)
                raise CorruptCheckpoint(f"{where}: {'missing' if size is None else f'{size} bytes'}, the "
                                        f"manifest says {fe.file_bytes}", path=where)
            remote.download(rel, os.path.join(part, fe.name), fe.file_bytes)
    except BaseException:
        tier.abort(step)
        raise
    tier.commit(step, man, overwrite=True)


def load(path: str, state_dict: Any = None, step: int | None = None, map_location: Any = None, *,
         verify: bool = True, fallback: bool = True, engine: Engine | None = None,
         bounce: Arena | None = None, io: IOConfig | None = None, rank: int = 0, world_size: int = 1,
         remote: Any = None, keys: list[str] | None = None, strict: bool = False,
         report: LoadReport | None = None) -> Any:
    """Load the newest verified checkpoint (or ``step``) under ``path``; see the module doc.

    With ``remote`` (a URL or tier), steps only the remote holds are downloaded into ``path``
    first; for each step, newest first, the local copy is tried, then the remote one. Any
    failure of a step's checkpoint (not of the caller's state dict) falls back to the previous
    step; a step deleted meanwhile (retention) is not a failure: the listing is read again.
    ``report`` (a :class:`LoadReport`) is filled in with the step loaded and the key report.
    """
    remote_why = ""
    remote_steps: list[int] = []
    if remote is not None:
        from ..store.remote import list_steps, open_tier
        if isinstance(remote, str):
            remote = open_tier(remote, io=io)
        listed, remote_why = list_steps(remote)
        remote_steps = listed or []
    if keys is not None:
        if isinstance(keys, str) or not all(isinstance(k, str) for k in keys):
            raise ConfigError(f"keys={keys!r} must be a list of str (dotted key paths)")
        keys = list(keys)
    location_mapper(map_location)  # bad map_location: fail before reading anything
    report = report if report is not None else LoadReport()
    tier = LocalTier(path, create=False)
    if remote is not None and not os.path.isdir(tier.root):
        tier = LocalTier(path, create=True)
    own_engine = engine is None
    bounce = bounce or _shared_bounce()
    tried: set[tuple[int, str]] = set()
    replaced: dict[int, int] = {}
    refetched: set[int] = set()
    seen_local: dict[int, Any] = {}  # step -> identity of the local manifest this load tried
    errors: list[str] = []
    try:
        while True:
            steps = tier.listed_steps()  # damaged ones too: each is tried and its defect reported
            every = sorted(set(steps) | set(remote_steps))
            if step is not None:
                every = [s for s in every if s == step]
            todo = [(s, src) for s in reversed(every)
                    for src in (["local"] if s in steps else []) + (["remote"] if s in remote_steps else [])
                    if (s, src) not in tried]
            if not todo or (errors and not fallback):
                break
            s, src = todo[0]
            tried.add((s, src))
            if engine is None:
                engine = choose_engine(tier.root, io or IOConfig())
            fetched = False
            ident = tier.manifest_ident(s) if src == "local" else listed_ident(remote, s)
            if src == "local":
                seen_local[s] = ident
            try:
                if src == "remote":
                    fetched = _fetch(tier, remote, s, seen_local.get(s))[1]
                out = load_step(tier, s, engine, bounce, state_dict, map_location, verify, rank, world_size,
                                keys=keys, strict=strict, report=report)
            except (StateMismatchError, ConfigError):
                raise  # the caller's state or arguments, not the checkpoint: an older step would not help
            except Exception as exc:  # noqa: BLE001 - every defect of a checkpoint means: try the previous one
                why = (changed_under(tier, s, ident) if src == "local"  # shared with verify
                       else remote_changed_under(remote, s, ident))
                if why is not None and fetched:
                    tier.delete(s)  # our download of the remote copy that was replaced (or removed) meanwhile
                if why == GONE:
                    log.info("zerostall: step %d disappeared while loading (retention?); listing again", s)
                    continue
                if why == REPLACED and replaced.get(s, 0) < MAX_REPLACED:
                    # the writer overwrote this step while we read it (old manifest, new shard): read it again
                    replaced[s] = replaced.get(s, 0) + 1
                    tried.discard((s, src))
                    log.info("zerostall: step %d was overwritten while loading; reading it again", s)
                    continue
                bad_ref = _damaged_local_ref(tier, s, exc) if fetched and s not in refetched else None
                if bad_ref is not None and bad_ref in remote_steps:
                    # an incremental step borrows from a local step whose file is damaged: the
                    # remote's copy of that step is what this remote step references
                    refetched.add(s)
                    log.warning("zerostall: step %d borrows from local step %d, which is damaged (%s); "
                                "fetching step %d from the remote again", s, bad_ref, exc, bad_ref)
                    try:
                        fetch_remote_step(tier, remote, bad_ref)
                        tried.discard((s, src))
                        continue
                    except Exception as fexc:  # noqa: BLE001 - reported below with the original defect
                        log.error("zerostall: fetching step %d again failed: %s", bad_ref, fexc)
                reason = str(exc) if isinstance(exc, ZerostallError) else f"{type(exc).__name__}: {exc}"
                log.error("zerostall: step %d (%s copy) failed: %s", s, src, reason)
                errors.append(f"step {s} ({src}): {reason}")
                if fetched and isinstance(exc, CorruptCheckpoint):
                    tier.delete(s)  # drop the bad download (a failed fetch committed nothing: a local copy stays)
                continue
            report.step, report.source, report.failed = s, src, list(errors)
            if errors:
                log.warning("zerostall: loaded step %d (%s) after newer copies failed: %s", s, src,
                            "; ".join(errors))
            else:
                log.info("zerostall: loaded step %d from %s (%s)", s, tier.root, src)
            if report.missing_keys:
                log.warning("zerostall: step %d lacks %d keys of the state dict (left unchanged): %s", s,
                            len(report.missing_keys), ", ".join(report.missing_keys[:10]))
            if report.unexpected_keys:
                log.info("zerostall: step %d holds %d keys the state dict lacked (added): %s", s,
                         len(report.unexpected_keys), ", ".join(report.unexpected_keys[:10]))
            return out
        if not errors:
            if remote_why and not tried:
                raise RemoteError(f"no committed checkpoint in {tier.root!r}, and the remote tier could not be "
                                  f"listed: {remote_why}", url=remote.url)
            where = f"{tier.root!r}" + (f" or {remote.url}" if remote is not None else "")
            if step is not None:
                raise CheckpointNotFound(f"no committed checkpoint for step {step} in {where} "
                                         f"(steps: {sorted(set(tier.listed_steps()) | set(remote_steps)) or 'none'})")
            parts = tier.partial_steps()
            extra = f" ({len(parts)} unfinished .partial directories)" if parts else ""
            raise CheckpointNotFound(f"no committed checkpoint in {where}{extra}")
        raise CorruptCheckpoint(f"no checkpoint in {tier.root!r} verifies: " + "; ".join(errors) +
                                (" The state dict was not modified." if state_dict is not None else ""),
                                path=tier.root)
    finally:
        if own_engine and engine is not None:
            engine.close()


def verify_tier_step(tier: Any, step: int, bounce: Arena | None = None) -> Manifest:
    """Read every byte of ``step`` on any tier through its ``open_shard_read`` (a remote tier
    streams its objects; nothing is stored locally) and check it as a load does: header,
    every tensor's crc32c, zero padding. Raises CorruptCheckpoint (RemoteError if the tier
    cannot be read)."""
    man = tier.read_manifest(step)
    bounce = bounce or _shared_bounce()
    by_file: dict[str, list[_Target]] = {}
    for e in sorted(man.tensors, key=lambda e: e.offset):
        if e.step is None:  # own bytes; references are checked below
            by_file.setdefault(e.file, []).append(_Target(e, None, False))
    with _bounce_lock if bounce is _bounce else _nolock():
        for fe in man.files:
            where = f"{tier.url.rstrip('/')}/step-{step}/{fe.name}"
            size = tier.stat(f"step-{step}/{fe.name}") if hasattr(tier, "stat") else fe.file_bytes
            if size is None:
                raise CorruptCheckpoint(f"{where}: shard is missing", path=where)
            if size != fe.file_bytes:
                raise CorruptCheckpoint(f"{where}: shard is {size} bytes, manifest says {fe.file_bytes}",
                                        path=where)
            header = ShardHeader(fe.file_id or man.checkpoint_id, man.step, fe.rank, fe.file_bytes)
            with tier.open_shard_read(step, fe.name) as f:
                _stream_file(f, where, fe.file_bytes, header, by_file.get(fe.name, []), bounce, True)
        if man.ref_files:
            from .refs import verify_tier_refs
            verify_tier_refs(tier, man, bounce)
    return man
