"""Whether every rank has staging room for the next save: ``backpressure="skip"`` across ranks.

A step skipped on one rank only would fail everywhere (its commit round cannot complete), so
in ``save()`` (caller's thread, every rank, in the same order of saves) the ranks skip
together when any one has no room::

    add(<prefix>/room<seq>, 1 + BUSY * busy)   # one request per rank
    last to arrive: set(<prefix>/room<seq>/all, total)
    the others: poll for .../all (bounded), read it; skip iff total >= BUSY

``seq`` counts this Checkpointer's skip-mode saves, the same on every rank. Rank 0 deletes the
keys of ``seq - 2``: every rank added to ``seq - 1`` before ``seq`` could complete, so has read
them.
"""

from __future__ import annotations

import time

from .session import Session
from .store import Store

BUSY = 1 << 20
"""Added by a rank without room (world sizes stay below it)."""


def agree_room(store: Store, session: Session, seq: int, room: bool, timeout_s: float,
               abort: str | None = None) -> bool | None:
    """True when every rank has room for save ``seq``, False when some rank has none, None when
    ``abort`` appeared (a rank's ``save()`` failed first and reported the step) or a rank did not
    answer within ``timeout_s`` (the caller skips alone). Caller's thread, bounded by
    ``timeout_s`` (plus a store request's own bound)."""
    key = f"{session.prefix}/room{seq}"
    total = store.add(key, 1 if room else 1 + BUSY, timeout=timeout_s)
    if total % BUSY == session.world:  # the last to arrive tells the others
        store.set(f"{key}/all", str(total), timeout=timeout_s)
    else:
        if store.poll([f"{key}/all"], time.monotonic() + timeout_s, abort=abort) != "ok":
            return None
        total = int(store.get(f"{key}/all", timeout=timeout_s))
    if session.rank == 0 and seq >= 2:
        old = f"{session.prefix}/room{seq - 2}"
        store.delete(old, f"{old}/all")
    return total < BUSY
