"""Downloading a step from a remote tier into the local one (``load(..., remote=...)``, ``restore_remote``).

Called from the caller's thread. One process at a time downloads into a root
(:class:`_FetchLock`); the step is written into its ``.partial`` and committed like a save's
(replacing a local copy), the steps it borrows from first.
"""

from __future__ import annotations

import contextlib
import logging
import os
from typing import Any

from ..errors import CorruptCheckpoint, ZerostallError
from ..format.manifest import Manifest
from ..format.decode import tree_tensor_indices
from ..store.owner import FileLock, StepLock
from ..store.tier import RootTier, Tier
from ..store.atomic import fsync_dir, unlinked_on_error

log = logging.getLogger("zerostall")


def damaged_local_ref(tier: RootTier, step: int, exc: BaseException) -> int | None:
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
    the owner's root lock, which a training run holds for its lifetime. A
    :class:`~zerostall.store.owner.FileLock` that is never removed, so a child forked meanwhile
    neither keeps it (its at-fork handler closes its copy) nor unlocks it."""

    def __init__(self, root: str):
        self.path = os.path.join(root, FETCH_LOCK_NAME)
        self._lock = FileLock(self.path)

    def __enter__(self) -> "_FetchLock":
        self._lock.acquire(wait=True)
        if not self._lock.enforced:
            log.warning("zerostall: %s does not support flock: concurrent restores into it may collide",
                        os.path.dirname(self.path))
        return self

    def __exit__(self, *exc: object) -> None:
        self._lock.release(unlink=False)


_ANY = object()


def fetch_remote_step(tier: RootTier, remote: Tier, step: int, seen: Any = _ANY) -> Manifest:
    """Download ``step`` from ``remote`` into the local tier (direct I/O) and commit it there
    (replacing a local copy; the steps it borrows from are fetched first if missing locally)."""
    return fetch(tier, remote, step, seen)[0]


def rank_files(man: Manifest, rank: int, world_size: int) -> set[str] | None:
    """The files of ``man`` that rank ``rank`` reads (a per-rank checkpoint saved by
    ``world_size`` ranks); None: all of them (replicated, or another world size)."""
    if man.rank_trees is None or man.world_size != world_size or not 0 <= rank < world_size:
        return None
    canon = man.alias_of
    return {man.tensors[canon.get(i, i)].file for i, _ in tree_tensor_indices(man.tree_for(rank, world_size))}


def fetch(tier: RootTier, remote: Tier, step: int, seen: Any = _ANY, only: set[str] | None = None,
          who: tuple[int, int] | None = None) -> tuple[Manifest, bool]:
    """:func:`fetch_remote_step`; also says whether this call downloaded it (False: another
    process committed the same checkpoint locally since the caller saw ``seen``, the identity
    of the local manifest the caller found missing (None) or damaged; ``_ANY``: always download).
    One process at a time downloads into a root (:class:`_FetchLock`). ``who`` = (rank,
    world_size): a per-rank checkpoint fetches only that rank's files (and the manifest); a
    local copy of the same checkpoint that lacks them gets them added in place."""
    man = remote.read_manifest(step)  # validated; names this step
    if who is not None:
        only = rank_files(man, *who)
    os.makedirs(tier.root, exist_ok=True)
    for ref in sorted({r.step for r in man.ref_files}):  # an incremental step: what it borrows, first
        if ref not in tier.steps():
            fetch(tier, remote, ref, None)
    with _FetchLock(tier.root):
        now = tier.manifest_ident(step)
        same = False
        if now is not None:
            with contextlib.suppress(ZerostallError):
                same = tier.read_manifest(step).checkpoint_id == man.checkpoint_id
        if same and only is not None:  # another rank of this node fetched its own files of it
            _add_files(tier, remote, step, man, only)
            return man, True
        if seen is not _ANY and now is not None and now != seen and same:
            log.info("zerostall: step %d was fetched into %s by another process", step, tier.root)
            return man, False
        staging = StepLock(tier.root, step)  # the owner's start-up cleanup leaves our .partial alone
        staging.acquire()
        try:
            _download(tier, remote, step, man, only)
        finally:
            staging.release(unlink=True)
    log.info("zerostall: fetched step %d from %s into %s", step, remote.url, tier.root)
    return man, True


def _add_files(tier: RootTier, remote: Any, step: int, man: Manifest, only: set[str]) -> None:
    """Download the files in ``only`` into the committed local copy of ``step`` (which lacks them,
    or holds copies that failed), each into a temporary name in it, then renamed into place
    (caller holds the fetch lock)."""
    d = tier.step_dir(step)
    for fe in man.files:
        path = os.path.join(d, fe.name)
        if fe.name not in only:  # ours are fetched again even if present: the local ones failed
            continue
        rel = _checked_rel(remote, step, fe.name, fe.file_bytes)
        with unlinked_on_error(os.path.join(d, f".fetch-{fe.name}.tmp")) as tmp:
            remote.download(rel, tmp, fe.file_bytes)
            os.rename(tmp, path)
    fsync_dir(d)


def _checked_rel(remote: Any, step: int, name: str, nbytes: int) -> str:
    """``step-N/<name>`` on ``remote``, after checking it holds the manifest's ``nbytes``
    (CorruptCheckpoint naming the remote object otherwise)."""
    rel = f"step-{step}/{name}"
    size = remote.stat(rel)
    if size != nbytes:
        where = remote.where(rel)
        raise CorruptCheckpoint(f"{where}: {'missing' if size is None else f'{size} bytes'}, the "
                                f"manifest says {nbytes}", path=where)
    return rel


def _download(tier: RootTier, remote: Any, step: int, man: Manifest, only: set[str] | None = None) -> None:
    """Download ``step``'s files (those in ``only``, if given) into its ``.partial`` and commit it
    (caller holds the locks)."""
    part = tier.begin(step)
    try:
        for fe in man.files:
            if only is not None and fe.name not in only:
                continue
            rel = _checked_rel(remote, step, fe.name, fe.file_bytes)
            remote.download(rel, os.path.join(part, fe.name), fe.file_bytes)
    except BaseException:
        tier.abort(step)
        raise
    tier.commit(step, man, overwrite=True)
