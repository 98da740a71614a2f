"""Retention policies: which committed steps each tier keeps.

Pure functions of the step lists; the replicator (or the persist thread, without a remote
tier) applies them and logs what it removes. Invariants, whatever the policy says: the
newest committed step of a tier is never deleted, and with a remote tier configured a local
step that is not yet replicated is never deleted.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..errors import ConfigError


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

    def to_replicate(self, local: list[int], remote: list[int]) -> list[int]:
        """Local steps the remote tier lacks and would keep once uploaded, ascending.

        A local step older than what remote retention keeps is never uploaded (it would be
        deleted at once); local retention may then remove it like any replicated step.
        """
        missing = sorted(set(local) - set(remote))
        doomed = set(self.remote_doomed(sorted(set(remote) | set(missing))))
        return [s for s in missing if s not in doomed]

    def remote_doomed(self, steps: list[int]) -> list[int]:
        if self.keep_last_remote is None or not steps:
            return []
        steps = sorted(steps)
        newest = steps[-1]
        every = self.keep_every_remote
        return [s for s in steps[:-self.keep_last_remote]
                if s != newest and not (every and s % every == 0)]
