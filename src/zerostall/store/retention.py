"""Retention policies: which committed steps each tier keeps.

Pure functions of the step lists; the replicator (or the persist thread, without a remote
tier) applies them and logs what it removes. Invariants, whatever the policy says: the
newest committed step of a tier is never deleted, with a remote tier configured a local
step that is not yet replicated is never deleted, and a step referenced by a step that stays
(incremental saves, :mod:`..format.refs`) stays too — counted from the manifests on the tier
(:func:`spare_referenced`), never from memory.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

from ..errors import ConfigError, ZerostallError
from ..format.refs import closure, referenced_steps


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

    def local_doomed(self, steps: list[int], replicated: set[int] | None) -> list[int]:
        """Local steps to delete; ``replicated`` is None when there is no remote tier."""
        if self.keep_last_local is None or not steps:
            return []
        steps = sorted(steps)
        newest = steps[-1]
        out = [s for s in steps[:-self.keep_last_local] if s != newest]
        if replicated is not None:
            out = [s for s in out if s in replicated]
        return out

    def remote_doomed(self, steps: list[int]) -> list[int]:
        if self.keep_last_remote is None or not steps:
            return []
        steps = sorted(steps)
        newest = steps[-1]
        every = self.keep_every_remote
        return [s for s in steps[:-self.keep_last_remote]
                if s != newest and not (every and s % every == 0)]


def spare_referenced(steps: list[int], doomed: list[int], read_manifest: Callable[[int], Any],
                     protect: set[int] = frozenset()) -> list[int]:  # type: ignore[assignment]
    """``doomed`` minus ``protect`` and every step that a step staying references, transitively,
    newest first: **delete in this order**. References point backwards, so a crash between two
    deletions then never leaves a step whose referenced step is gone.

    ``read_manifest(step)`` reads a manifest from the tier being cleaned (the local tier or a
    remote one); one that cannot be read references nothing (that step cannot be loaded).
    """
    doomed = sorted((s for s in doomed if s not in protect), reverse=True)
    if not doomed:
        return doomed

    def refs_of(s: int) -> set[int]:
        try:
            return referenced_steps(read_manifest(s))
        except (ZerostallError, OSError, ValueError):
            return set()

    needed = closure(set(steps) - set(doomed), refs_of)
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
