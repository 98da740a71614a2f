"""Retention policies: which committed steps each tier keeps.

Pure functions of step lists, and the one loop that applies them (:func:`prune`), run by
:class:`LocalRetention` (persist thread), :func:`retain_at_start` or the replicator. Invariants:

- only *committed* steps (manifest validates, ``Tier.steps()``) are counted or deleted;
- never the newest committed step, nor the step just committed (``protect``), nor, with a
  remote tier, a local step not yet replicated;
- a step referenced by a step that stays (incremental saves) stays too, read from the
  manifests on the tier (:func:`spare_referenced`); deletions run newest first.

Steps are ranked by number (``save`` refuses a lower step, :class:`~zerostall.errors.StepOrderError`,
unless ``allow_lower_steps=True``; then the writer protects its own newest ``keep_last``
commits, :func:`retain_at_start`). A kill between a commit and its retention leaves one step
too many, which the next owner removes first: at most ``K + 1`` committed steps with ``keep_last=K``.
"""

from __future__ import annotations

import functools
import logging
from collections import deque
from dataclasses import dataclass
from typing import Any, Callable, Collection, Iterable

from ..errors import CheckpointExistsError, CheckpointNotFound, ZerostallError
from ..format.refs import closure, referenced_steps

log = logging.getLogger("zerostall")


def doomed(steps: Iterable[int], keep_last: int | None, protect: Iterable[int] = ()) -> list[int]:
    """The steps to delete so that the newest ``keep_last`` of ``steps`` (committed, validated)
    remain; never the newest one and never one in ``protect``. Ascending."""
    ordered = sorted(set(steps))
    if keep_last is None or not ordered:
        return []
    keep = set(ordered[-keep_last:]) | {ordered[-1]} | set(protect)
    return [s for s in ordered if s not in keep]


@dataclass(frozen=True, kw_only=True)
class RetentionPolicy:
    keep_last_local: int | None = None
    keep_last_remote: int | None = None
    keep_every_remote: int | None = None
    """Also keep every step divisible by this on the remote tier (e.g. 1000). The values are
    checked by :class:`~zerostall.config.CheckpointConfig`."""

    def local_doomed(self, steps: list[int], replicated: set[int]) -> list[int]:
        """Local steps to delete: only replicated ones."""
        return [s for s in doomed(steps, self.keep_last_local) if s in replicated]

    def to_replicate(self, local: list[int], remote: list[int]) -> list[int]:
        """Local steps the remote tier lacks and would keep once uploaded, ascending (one
        remote retention would delete at once is never uploaded)."""
        missing = sorted(set(local) - set(remote))
        doomed = set(self.remote_doomed(sorted(set(remote) | set(missing))))
        return [s for s in missing if s not in doomed]

    def remote_doomed(self, steps: list[int], protect: Iterable[int] = ()) -> list[int]:
        every = self.keep_every_remote
        return [s for s in doomed(steps, self.keep_last_remote, protect) if not (every and s % every == 0)]


@dataclass(frozen=True)
class ManifestRefs:
    """The part of a step's manifest retention reads (``LocalTier.manifest_refs``)."""

    step: int
    ref_files: tuple[Any, ...] = ()


def spare_referenced(steps: list[int], doomed: list[int], read_manifest: Callable[[int], Any],
                     protect: Collection[int] = ()) -> list[int]:
    """``doomed`` minus ``protect`` and every step that a step staying references, transitively,
    newest first: **delete in this order** (references point backwards, so a crash between two
    deletions never orphans a reference). If a staying step's manifest cannot be read, nothing
    is deleted this time (logged): retention may keep too much, never too little."""
    doomed = sorted((s for s in doomed if s not in protect), reverse=True)
    if not doomed:
        return doomed
    unknown: list[tuple[int, BaseException]] = []

    def refs_of(s: int) -> set[int]:
        try:
            return referenced_steps(read_manifest(s))
        except CheckpointNotFound:
            return set()
        except (ZerostallError, OSError, ValueError) as exc:
            unknown.append((s, exc))
            return set()

    needed = closure(set(steps) - set(doomed), refs_of)
    if unknown:
        s, exc = unknown[0]
        log.warning("zerostall: retention deletes nothing this time: cannot read the manifest of kept "
                    "step %d to see which steps it references (%s)", s, exc)
        return []
    return [s for s in doomed if s not in needed]


def dependents(steps: list[int], step: int, read_manifest: Callable[[int], Any]) -> list[int]:
    """Committed steps whose manifests reference ``step`` (references point backwards)."""
    out = []
    for s in steps:
        if s > step:
            try:
                if step in referenced_steps(read_manifest(s)):
                    out.append(s)
            except (ZerostallError, OSError, ValueError):
                pass
    return out


def prune(tier: Any, steps: list[int], doomed_steps: list[int], *, protect: Collection[int] = (),
          cancelled: Callable[[], bool] = lambda: False, defer: bool = False) -> list[int]:
    """Delete ``doomed_steps`` of ``tier`` that no staying step references, newest first
    (:func:`spare_referenced`), until ``cancelled()``; returns what went. Run by the thread
    that owns the tier's writes; ``defer``: files removed later (``LocalTier.deferred``)."""
    gone = []
    read = getattr(tier, "manifest_refs", tier.read_manifest)  # the local tier's: no re-parse of its own
    delete = functools.partial(tier.delete, defer=True) if defer else tier.delete
    for s in spare_referenced(steps, doomed_steps, read, protect):
        if cancelled():
            break
        delete(s)
        gone.append(s)
    if gone:
        log.info("zerostall: retention removed steps %s from %s", gone, getattr(tier, "url", tier))
    return gone


def check_not_referenced(tier: Any, step: int, pinned: set[int], *, queued: bool = False) -> None:
    """:class:`~zerostall.errors.CheckpointExistsError` if steps borrow ``step``'s bytes or a
    save in flight pinned it. ``save()`` checks on the caller's thread; the persist thread again
    (``queued=True``) just before the commit (a save queued before may reference it since)."""
    users = dependents(tier.steps(), step, tier.read_manifest)
    if users or step in pinned:
        raise CheckpointExistsError(
            f"step {step} in {getattr(tier, 'root', tier.url)!r} cannot be overwritten: steps "
            f"{users or 'being saved'} reference its bytes (incremental saves); "
            f"{'nothing committed, ' if queued else ''}pick another step")


class LocalRetention:
    """``keep_last`` on the local tier after each commit (a commit subscriber, persist thread, no
    remote); ``recent``: this writer's newest commits, oldest first, never deleted."""

    name = "retention"

    def __init__(self, tier: Any, keep_last: int, *, protect: Callable[[], set[int]] = set,
                 recent: Iterable[int] = ()):
        self.tier, self.keep_last, self.protect = tier, keep_last, protect
        self._recent: deque[int] = deque(recent, maxlen=keep_last or 1)

    def on_committed(self, record: Any) -> None:
        self._recent.append(record.step)
        keep = set(self._recent) | self.protect() | {record.step}
        steps = self.tier.steps()
        prune(self.tier, steps, doomed(steps, self.keep_last, keep), defer=True)


def retain_at_start(tier: Any, keep_last: int, protect: Collection[int] = ()) -> list[int]:
    """Start-up retention by a root's new owner (caller's thread, after ``own()``, before any
    save; no remote): removes what a kill between a commit and its retention left. Logs a
    failure, never raises. Returns the ``keep_last`` steps committed last, by their manifests'
    ``created_unix`` (then step; an unreadable manifest ranks oldest), oldest first: kept, and
    handed to :class:`LocalRetention`."""
    def when(s: int) -> tuple[float, int]:
        try:
            return float(tier.read_manifest(s).created_unix), s
        except (ZerostallError, OSError, ValueError):
            return float("-inf"), s

    steps = tier.steps()
    recent = sorted(steps, key=when)[-keep_last:] if keep_last > 0 else []
    try:
        prune(tier, steps, doomed(steps, keep_last, set(recent) | set(protect)))
    except Exception as exc:  # noqa: BLE001 - an extra step on disk is not worth refusing to start
        log.warning("zerostall: start-up retention (keep_last=%d) in %s failed: %s", keep_last,
                    getattr(tier, "root", tier), exc)
    return recent
