"""Retention policies: which committed steps each tier keeps.

Pure functions of step lists, and the one loop that applies them (:func:`prune`): the
:class:`LocalRetention` commit subscriber (persist thread; local tier, no remote) or the
replicator runs it through the tier and logs what it removes. Invariants, whatever the policy
says:

- it acts only on *committed* steps, i.e. steps whose manifest validates (``Tier.steps()``):
  a damaged or foreign ``step-N`` directory is never counted toward ``keep_last`` and never
  deleted by retention;
- the newest committed step of a tier is never deleted, nor the step just committed
  (``protect``), nor, with a remote tier, a local step not yet replicated;
- a step referenced by a step that stays (incremental saves, :mod:`..format.refs`) stays
  too, counted from the manifests on the tier (:func:`spare_referenced`), never from
  memory; deletions run newest first.

Steps are ranked by number. That is only meaningful for one run's history, so a root never
mixes runs silently: ``Checkpointer.save`` refuses a step lower than the root's newest
committed step (:class:`~zerostall.errors.StepOrderError`) unless ``allow_lower_steps=True``.
The writer also protects its own newest ``keep_last`` commits from retention, so with
``allow_lower_steps`` an older run's higher steps never push the new run's saves out: those
are pruned only by the new run's own newer saves (the older run's steps stay until deleted
by hand, and ``load()`` still picks the highest step). "Its own" survives restarts: a new
owner starts from the ``keep_last`` steps committed last (:func:`newest_commits`, by the
manifest's ``created_unix``), which only ever keeps more, never deletes more.

When retention runs (local tier, no remote): after each commit (:class:`LocalRetention`, a
subscriber of the persist thread's ``Committed`` records), and once
when a writer takes the root (``Checkpointer`` construction, after ``LocalTier.own()``,
before any save). A kill between a commit and its retention leaves one step too many; the
next owner removes it before it commits anything, so a root written with ``keep_last=K``
never holds more than ``K + 1`` committed steps, however many runs are killed, and an owner
with ``keep_last=K`` holds at most ``K`` between saves (``tests/fault/test_crash_anywhere.py``).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any, Callable, Iterable

from ..errors import CheckpointNotFound, ConfigError, ZerostallError
from ..format.refs import closure, referenced_steps
from ..errors import CheckpointExistsError

log = logging.getLogger("zerostall")


def doomed(steps: Iterable[int], keep_last: int | None, protect: Iterable[int] = ()) -> list[int]:
    """The steps to delete so that the newest ``keep_last`` of ``steps`` (committed, validated)
    remain; never the newest one and never one in ``protect``. Ascending."""
    ordered = sorted(set(steps))
    if keep_last is None or not ordered:
        return []
    keep = set(ordered[-keep_last:]) | {ordered[-1]} | set(protect)
    return [s for s in ordered if s not in keep]


def newest_commits(steps: Iterable[int], read_manifest: Callable[[int], Any], n: int) -> list[int]:
    """The ``n`` of ``steps`` committed last, by their manifests' ``created_unix`` (then step),
    oldest first: what a new owner of a root protects as "its own newest commits". A manifest
    that cannot be read ranks first (oldest). Only ever used to keep steps, so a wrong clock can
    make retention keep more, never delete more."""
    def when(s: int) -> tuple[float, int]:
        try:
            return float(read_manifest(s).created_unix), s
        except (ZerostallError, OSError, ValueError):
            return float("-inf"), s
    ranked = sorted(set(steps), key=when)
    return ranked[-n:] if n > 0 else []


@dataclass(frozen=True, kw_only=True)
class RetentionPolicy:
    keep_last_local: int | None = None
    keep_last_remote: int | None = None
    keep_every_remote: int | None = None
    """Also keep every step divisible by this on the remote tier (e.g. 1000)."""

    def __post_init__(self) -> None:
        for name in ("keep_last_local", "keep_last_remote", "keep_every_remote"):
            v = getattr(self, name)
            if v is not None and v < 1:
                raise ConfigError(f"{name}={v!r} is invalid: must be >= 1 or None")

    def local_doomed(self, steps: list[int], replicated: set[int] | None,
                     protect: Iterable[int] = ()) -> list[int]:
        """Local steps to delete; ``replicated`` is None when there is no remote tier."""
        out = doomed(steps, self.keep_last_local, protect)
        if replicated is not None:
            out = [s for s in out if s in replicated]
        return out

    def to_replicate(self, local: list[int], remote: list[int]) -> list[int]:
        """Local steps the remote tier lacks and would keep once uploaded, ascending.

        A local step older than what remote retention keeps is never uploaded (it would be
        deleted at once); local retention may then remove it like any replicated step.
        """
        missing = sorted(set(local) - set(remote))
        doomed = set(self.remote_doomed(sorted(set(remote) | set(missing))))
        return [s for s in missing if s not in doomed]

    def remote_doomed(self, steps: list[int], protect: Iterable[int] = ()) -> list[int]:
        every = self.keep_every_remote
        return [s for s in doomed(steps, self.keep_last_remote, protect) if not (every and s % every == 0)]


@dataclass(frozen=True)
class ManifestRefs:
    """The part of a step's manifest retention reads: which earlier steps' files it borrows
    (``LocalTier.manifest_refs``; :func:`~zerostall.format.refs.referenced_steps` takes it
    like a manifest)."""

    step: int
    ref_files: tuple[Any, ...] = ()


def spare_referenced(steps: list[int], doomed: list[int], read_manifest: Callable[[int], Any],
                     protect: set[int] = frozenset()) -> list[int]:  # type: ignore[assignment]
    """``doomed`` minus ``protect`` and every step that a step staying references, transitively,
    newest first: **delete in this order**. References point backwards, so a crash between two
    deletions then never leaves a step whose referenced step is gone.

    ``read_manifest(step)`` reads a manifest from the tier being cleaned (the local tier or a
    remote one). A step that is gone (CheckpointNotFound) references nothing. A staying step
    whose manifest cannot be read now (a remote answering 503, an I/O error, a manifest damaged
    since the listing validated it) may reference any doomed step, so nothing is deleted this
    time (logged): retention may keep too much, never delete a step that a kept one needs.
    """
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


def prune(tier: Any, steps: list[int], doomed_steps: list[int], *, protect: set[int] = frozenset(),  # type: ignore[assignment]
          cancelled: Callable[[], bool] = lambda: False, defer: bool = False) -> list[int]:
    """Delete ``doomed_steps`` of ``tier`` (whose committed steps are ``steps``) that no staying
    step references, newest first (:func:`spare_referenced`), until ``cancelled()``; logs and
    returns what went. The one apply loop of every tier's retention (the thread that owns the
    tier's writes: persist thread, replicator, or the caller's at start-up). ``defer`` (the
    local tier, from its persist thread): the steps leave the listing now, their files are
    removed by the persist thread later (``LocalTier.deferred``)."""
    gone = []
    read = getattr(tier, "manifest_refs", tier.read_manifest)  # the local tier's: no re-parse of its own
    for s in spare_referenced(steps, doomed_steps, read, protect):
        if cancelled():
            break
        if defer:
            tier.delete(s, defer=True)
        else:
            tier.delete(s)
        gone.append(s)
    if gone:
        log.info("zerostall: retention removed steps %s from %s", gone, getattr(tier, "url", tier))
    return gone


def check_not_referenced(tier: Any, step: int, pinned: set[int], *, queued: bool = False) -> None:
    """Overwriting ``step`` would break the steps that borrow its bytes (incremental saves):
    raise :class:`~zerostall.errors.CheckpointExistsError` if any does, or a save in flight
    pinned it. ``save()`` checks on the caller's thread; the persist thread checks again
    (``queued=True``) just before the commit: a save queued before may reference it since."""
    users = dependents(tier.steps(), step, tier.read_manifest)
    if users or step in pinned:
        raise CheckpointExistsError(
            f"step {step} in {getattr(tier, 'root', tier.url)!r} cannot be overwritten: steps "
            f"{users or 'being saved'} reference its bytes (incremental saves); "
            f"{'nothing committed, ' if queued else ''}pick another step")


class LocalRetention:
    """``keep_last`` on the local tier after each commit: a commit subscriber (persist thread;
    local tier without a remote, on the rank(s) that own the root's retention). A doomed step
    leaves the listing here; its files are removed by the persist thread while the next save's
    writes are in flight, or at once when nothing is queued (``LocalTier.deferred``).

    ``recent``: this writer's newest committed steps, oldest first, seeded with the root's last
    commits (:func:`retain_at_start`): retention never deletes them (see the module docstring)."""

    name = "retention"

    def __init__(self, tier: Any, keep_last: int, *, protect: Callable[[], set[int]] = set,
                 recent: Iterable[int] = ()):
        import collections
        self.tier, self.keep_last, self.protect = tier, keep_last, protect
        self._recent: collections.deque[int] = collections.deque(recent, maxlen=keep_last or 1)

    def on_committed(self, record: Any) -> None:
        self._recent.append(record.step)
        keep = set(self._recent) | self.protect() | {record.step}
        steps = self.tier.steps()
        prune(self.tier, steps, doomed(steps, self.keep_last, keep), defer=True)


def retain_at_start(tier: Any, keep_last: int, protect: set[int] = frozenset()) -> list[int]:  # type: ignore[assignment]
    """Start-up retention by a root's new owner (``Checkpointer`` construction, caller's thread,
    right after ``own()`` and before any save; local tier, no remote).

    A kill between a commit and its retention leaves a step beyond ``keep_last``; without
    this, each such kill in a row would add one more. Same invariants as after a commit:
    validated steps only, never the newest, never ``protect`` nor the steps committed last
    (:func:`newest_commits`), references spared, newest first. A failure is logged, never
    raised (nothing is lost by keeping a step).

    Returns the ``keep_last`` steps committed last, oldest first: :class:`LocalRetention`
    keeps protecting them as this writer's own newest commits.
    """
    recent = newest_commits(tier.steps(), tier.read_manifest, keep_last)
    try:
        steps = tier.steps()
        prune(tier, steps, doomed(steps, keep_last, set(recent) | set(protect)))
    except Exception as exc:  # noqa: BLE001 - an extra step on disk is not worth refusing to start
        log.warning("zerostall: start-up retention (keep_last=%d) in %s failed: %s", keep_last,
                    getattr(tier, "root", tier), exc)
    return recent
