"""Whether every rank has staging room for the next save: ``backpressure="skip"`` across ranks.

A step skipped on one rank fails everywhere, so in ``save()`` (caller's thread, every rank)
the ranks skip together when any one has no room::

    add(<prefix>/room<seq>, 1 + BUSY * busy)   # one request per rank
    last to arrive: set(<prefix>/room<seq>/all, total)
    the others: poll for .../all (bounded), read it; skip iff total >= BUSY

``seq`` counts the skip-mode saves. Rank 0 deletes ``seq - 2``'s keys: every rank added to
``seq - 1`` before ``seq`` could complete, so has read them.
"""

from __future__ import annotations

import time

from .session import Session
from .store import Store

BUSY = 1 << 20  # added by a rank without room (world sizes stay below it)


def agree_room(store: Store, session: Session, seq: int, room: bool, timeout_s: float,
               abort: str | None = None) -> bool | None:
    """True when every rank has room for save ``seq``, False when one has none, None when
    ``abort`` appeared (a rank's ``save()`` failed first) or a rank did not answer within
    ``timeout_s`` (the caller skips alone)."""
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
