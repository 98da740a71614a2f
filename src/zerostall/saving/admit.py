"""Admission of one save, before any block of the staging ring is reserved: may ``step`` be
written now (its order, an overwrite of a step others reference), and, with
``backpressure="skip"``, is there room for it now on every rank. Called only from
``Checkpointer.save`` on the caller's thread, under its save lock; not thread-safe.
"""

from __future__ import annotations

import logging
import time
from typing import Any

from ..errors import SaveFailed
from ..store.retention import check_not_referenced
from .job import Job

log = logging.getLogger("zerostall")


class StepOrder:
    """The step-order check of one Checkpointer: owning the root, above every step it has seen
    the check needs no listing. ``check`` before the save is planned, ``admitted`` after."""

    def __init__(self, tier: Any, refs: Any, *, allow_lower: bool):
        self._tier, self._refs, self._allow_lower = tier, refs, allow_lower
        self._bound: int | None = None  # owner only: no committed step is above it

    def check(self, step: int, overwrite: bool) -> None:
        """Raise unless ``step`` may be written (in order, or ``overwrite`` of an unreferenced step)."""
        fast = self._tier.owned and self._bound is not None and step > self._bound
        self._tier.check_new_step(step, overwrite, allow_lower=self._allow_lower or fast)
        if overwrite:
            check_not_referenced(self._tier, step, self._refs.pinned_steps() if self._refs is not None else set())

    def admitted(self, step: int) -> None:
        if self._tier.owned and (self._bound is None or step > self._bound):
            newest = self._tier.latest() if self._bound is None else None
            self._bound = max(step, newest if newest is not None else -1)


def room_now(ring: Any, committer: Any, step: int, nblocks: int) -> bool | None:
    """Whether ``nblocks`` fit in the staging ring now, agreed by every rank (``committer``:
    across ranks, None alone): False when any rank lacks room, None when a rank failed or is
    gone. Every rank then skips the step together, so no commit round starts for it."""
    room = ring.fits_now(nblocks)
    return committer.agree_room(step, room) if committer is not None else room


def skip(job: Job, t0: float, committer: Any, rank: int, *, report: bool = True) -> None:
    """Mark ``job`` skipped (routine when saving every step: docs/every-step.md); across ranks
    tell the others unless ``report`` is False (the room agreement already failed)."""
    job.status.skip(time.perf_counter() - t0)
    log.info("zerostall: step %d skipped: earlier saves still hold the staging arena", job.step)
    if committer is not None and report:
        committer.fail(job.request, SaveFailed(f"rank {rank} skipped step {job.step} (arena busy)", step=job.step))
