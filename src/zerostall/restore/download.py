"""Downloading a step from a remote tier into the local one (``load(..., remote=...)``, and
``zerostall restore URL --to DIR``: :func:`restore_remote`). Caller's thread, one process per
root at a time (:func:`fetch_lock`); committed like a save's, the steps it borrows first.
"""

from __future__ import annotations

import contextlib
import logging
import os
from typing import Any, Callable, Iterator

from ..distributed.finish import committed_here
from ..errors import CheckpointNotFound, ConfigError, CorruptCheckpoint, StateMismatchError, ZerostallError
from ..format.manifest import FileEntry, Manifest
from ..format.decode import tree_tensor_indices
from ..io.base import Engine
from ..store.owner import FileLock, StepLock
from ..store.local import LocalTier
from ..store.tier import Tier
from ..store.atomic import fsync_dir, unlinked_on_error
from .step import check_size, verify_step

log = logging.getLogger("zerostall")

FETCH_LOCK_NAME = ".zerostall.fetch.lock"
_ANY = object()


def damaged_local_ref(tier: LocalTier, step: int, exc: BaseException) -> int | None:
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


@contextlib.contextmanager
def fetch_lock(root: str) -> Iterator[None]:
    """An exclusive ``flock`` on ``<root>/.zerostall.fetch.lock`` while one process downloads
    into ``root`` (the ranks of a node take turns); not the owner's root lock. Never removed,
    so a child forked meanwhile neither keeps nor unlocks it."""
    lock = FileLock(os.path.join(root, FETCH_LOCK_NAME))
    lock.acquire(wait=True)
    if not lock.enforced:
        log.warning("zerostall: %s does not support flock: concurrent restores into it may collide", root)
    try:
        yield
    finally:
        lock.release(unlink=False)


def rank_files(man: Manifest, rank: int, world_size: int) -> set[str] | None:
    """The files of ``man`` that rank ``rank`` reads (a per-rank checkpoint saved by
    ``world_size`` ranks); None: all of them (replicated, or another world size)."""
    if man.rank_trees is None or man.world_size != world_size or not 0 <= rank < world_size:
        return None
    canon = man.alias_of
    return {man.tensors[canon.get(i, i)].file for i, _ in tree_tensor_indices(man.tree_for(rank, world_size))}


def fetch(tier: LocalTier, remote: Tier, step: int, seen: Any = _ANY,
          who: tuple[int, int] | None = None) -> tuple[Manifest, bool]:
    """Download ``step`` from ``remote`` into the local tier and commit it there (replacing a
    local copy; the steps it borrows first). Returns its manifest and whether this call
    downloaded it (False: another process committed it since the caller saw ``seen``, the
    local manifest's identity; ``_ANY``: always download). ``who`` = (rank, world_size): only
    that rank's files, added in place to a local copy of the same checkpoint."""
    man = remote.read_manifest(step)  # validated; names this step
    only = rank_files(man, *who) if who is not None else None
    os.makedirs(tier.root, exist_ok=True)
    for ref in sorted({r.step for r in man.ref_files}):  # an incremental step: what it borrows, first
        if ref not in tier.steps():
            fetch(tier, remote, ref, None)
    with fetch_lock(tier.root):
        now = tier.manifest_ident(step)
        same = now is not None and committed_here(tier, step, man.checkpoint_id)
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


def _add_files(tier: LocalTier, remote: Any, step: int, man: Manifest, only: set[str]) -> None:
    """Download the files in ``only`` into the committed local copy of ``step``, each through a
    temporary name (caller holds the fetch lock)."""
    d = tier.step_dir(step)
    for fe in man.files:
        if fe.name in only:  # ours are fetched again even if present: the local ones failed
            with unlinked_on_error(os.path.join(d, f".fetch-{fe.name}.tmp")) as tmp:
                _get(remote, step, fe, tmp)
                os.rename(tmp, os.path.join(d, fe.name))
    fsync_dir(d)


def _get(remote: Any, step: int, fe: FileEntry, dest: str) -> None:
    """Download ``step-N/<fe.name>`` to ``dest``, checked first to hold ``fe.file_bytes`` (else CorruptCheckpoint)."""
    check_size(remote, step, fe.name, fe.file_bytes, "the manifest says")
    remote.download(f"step-{step}/{fe.name}", dest, fe.file_bytes)


def _download(tier: LocalTier, remote: Any, step: int, man: Manifest, only: set[str] | None) -> None:
    """``step``'s files (``only``, if given) into its ``.partial``, then commit (locks held)."""
    part = tier.begin(step)
    try:
        for fe in man.files:
            if only is None or fe.name in only:
                _get(remote, step, fe, os.path.join(part, fe.name))
    except BaseException:
        tier.abort(step)
        raise
    tier.commit(step, man, overwrite=True)


def restore_remote(tier: LocalTier, remote: Any, engine: Engine, step: int | None = None, *,
                   on_failure: Callable[[int, str], None] | None = None) -> Manifest:
    """Download and verify the newest step of ``remote`` (or ``step``) into ``tier`` (owned by
    the caller) without loading it; returns its manifest. ``zerostall restore URL --to DIR``
    (which refuses a remote without steps first), with :func:`.pipeline.load`'s fallback: a
    step's defect is reported (``on_failure(step, reason)``), its download removed, the previous
    step tried. Raises ``CheckpointNotFound`` (no such step), ``CorruptCheckpoint`` (none
    verifies), ``ConfigError``.
    """
    steps = remote.steps()
    if step is not None:
        if step not in steps:
            raise CheckpointNotFound(f"no committed step {step} at {remote.url} (steps: {steps or 'none'})")
        steps = [step]
    errors: list[str] = []
    for s in reversed(steps):
        fetched = False
        try:
            fetch(tier, remote, s)
            fetched = True
            man = verify_step(tier, s, engine)
        except (StateMismatchError, ConfigError):
            raise
        except Exception as exc:  # noqa: BLE001 - every defect of a checkpoint means: try the previous one
            reason = str(exc) if isinstance(exc, ZerostallError) else f"{type(exc).__name__}: {exc}"
            log.error("zerostall: step %d (remote copy) failed: %s", s, reason)
            errors.append(f"step {s}: {reason}")
            if on_failure is not None:
                on_failure(s, reason)
            if fetched:  # our download committed and failed verification (a failed fetch committed nothing)
                try:
                    tier.delete(s)
                except Exception as dexc:  # noqa: BLE001 - reported, the next step is tried anyway
                    log.warning("zerostall: removing the failed download of step %d: %s", s, dexc)
            continue
        return man
    raise CorruptCheckpoint(f"no step of {remote.url} verifies: " + "; ".join(errors), path=remote.url)
