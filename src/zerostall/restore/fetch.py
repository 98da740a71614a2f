"""Restore a remote tier's newest step that verifies into a local root, without loading it.

The library's entry for ``zerostall restore URL --to DIR`` (the CLI calls nothing else), with
the fallback rule of :func:`.pipeline.load` (``remote=``): for each remote step, newest first
(or only ``step``), download it (:func:`.download.fetch_remote_step`, which fetches what an
incremental step borrows first) and read back every byte (:func:`.pipeline.verify_step`). Any
defect of that checkpoint (a damaged, missing or symlinked object, a failed download, a
crc32c mismatch) is reported, its download removed, and the previous step tried, as load()
does; an error of the arguments (``ConfigError``) is raised, an older step would not help.
The CLI used to fall back on ``CorruptCheckpoint`` only: a symlinked shard on a ``file://``
tier (an ``OSError`` of the download) made it exit 1 with an intact older step there.

Called from the caller's thread; the caller owns ``tier`` (``RootTier.own``).
"""

from __future__ import annotations

import logging
from typing import Any, Callable

from ..errors import CheckpointNotFound, ConfigError, CorruptCheckpoint, StateMismatchError, ZerostallError
from ..format.manifest import Manifest
from ..io.base import Engine
from ..store.tier import RootTier
from .pipeline import fetch_remote_step, verify_step
from .state import LoadReport

log = logging.getLogger("zerostall")


def restore_remote(tier: RootTier, remote: Any, engine: Engine, step: int | None = None, *,
                   report: LoadReport | None = None,
                   on_failure: Callable[[int, str], None] | None = None) -> Manifest:
    """Fetch and verify the newest step of ``remote`` (or ``step``) into ``tier``; its manifest.

    ``on_failure(step, reason)`` is told of each step that failed (the CLI prints them);
    ``report`` gets the step restored and those failures. Raises ``CheckpointNotFound`` when
    the remote holds no (such) step, ``CorruptCheckpoint`` when none verifies.
    """
    steps = remote.steps()
    if step is not None:
        if step not in steps:
            raise CheckpointNotFound(f"no committed step {step} at {remote.url} (steps: {steps or 'none'})")
        steps = [step]
    if not steps:
        raise CheckpointNotFound(f"no committed checkpoint at {remote.url}")
    errors: list[str] = []
    for s in reversed(steps):
        fetched = False
        try:
            fetch_remote_step(tier, remote, s)
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
        if report is not None:
            report.step, report.source, report.failed = s, "remote", list(errors)
        return man
    raise CorruptCheckpoint(f"no step of {remote.url} verifies: " + "; ".join(errors), path=remote.url)
