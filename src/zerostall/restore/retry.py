"""Reading a step that its writer may replace or delete while we read it.

Readers take no lock (:mod:`zerostall.store.local`): an overwrite or retention may change a
step under ``load`` or ``verify``, which then sees a defect that is not one. The rule both
share (:func:`.pipeline.load`, :func:`verify_consistent`): when reading a step fails, look at
its manifest again: gone, deleted meanwhile (not a failure); another identity, replaced
meanwhile (read it again, at most :data:`MAX_REPLACED` times); the same, the step's own
failure. Caller's thread; no I/O beyond a ``stat`` or a listing.
"""

from __future__ import annotations

import logging
from typing import Any, Callable, TypeVar

log = logging.getLogger("zerostall")
T = TypeVar("T")

MAX_REPLACED = 5

GONE, REPLACED = "gone", "replaced"


def changed_under(tier: Any, step: int, ident: Any, *, remote: bool = False) -> str | None:
    """:data:`GONE`, :data:`REPLACED` or None (unchanged) for ``step``, whose manifest had
    identity ``ident`` when the failed read began. ``remote``: None where ``ident`` is unknown
    or the tier cannot be listed (the failure is then the step's own)."""
    if remote and ident is None:
        return None
    try:
        now = tier.manifest_ident(step)
    except Exception:  # noqa: BLE001 - a listing that fails tells nothing
        if remote:
            return None
        raise
    if now is None:
        return GONE
    if ident is not None and now != ident:
        return REPLACED
    return None


def verify_consistent(tier: Any, step: int, check: Callable[[], T]) -> T | None:
    """``check()`` (a verify of ``step``), read again if the step was replaced under it; None
    if the step was deleted meanwhile. A failure of the step itself is raised."""
    for attempt in range(MAX_REPLACED + 1):
        ident = tier.manifest_ident(step)
        try:
            return check()
        except Exception:
            why = changed_under(tier, step, ident)
            # gone only if it was there when the read began (or is no longer listed): a step that
            # never read (a symlink loop, a missing manifest) is a failure, not a deletion
            if why == GONE and (ident is not None or step not in tier.listed_steps()):
                log.info("zerostall: step %d disappeared while verifying it (retention?)", step)
                return None
            if why != REPLACED or attempt == MAX_REPLACED:
                raise
            log.info("zerostall: step %d was overwritten while verifying it; reading it again", step)
    raise AssertionError("unreachable")
