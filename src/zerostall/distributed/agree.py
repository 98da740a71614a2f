"""Agreements of all ranks through the c10d store: the step every rank restores, and whether
every rank has staging room for the next save.

**The step.** :func:`zerostall.restore.pipeline.collective_load` (caller's thread, every rank,
collectively) calls :func:`agreed_load` under a ``base`` unique per call. Rounds, until one succeeds:

1. :func:`agree_step`: every rank posts its steps (``c/r<R>``); all take the newest common
   one (none: the same :class:`CheckpointNotFound` on every rank);
2. every rank verifies it into scratch, posts its outcome (``o/r<R>``) and waits for all (the
   *gate*), before its state dict changes;
3. all ok: every rank applies it; else every rank drops it and goes back to 1.

A fault of a caller's state dict (:class:`StateMismatchError`, :class:`ConfigError`) ends it
everywhere: that rank re-raises it, the others raise :class:`DistributedError` naming it.

**The room** (``backpressure="skip"`` across ranks, :func:`agree_room`). A step skipped on one
rank fails everywhere, so in ``save()`` (caller's thread, every rank) the ranks skip together
when any one has no room::

    add(<prefix>/room<seq>, 1 + BUSY * busy)   # one request per rank
    last to arrive: set(<prefix>/room<seq>/all, total)
    the others: poll for .../all (bounded), read it; skip iff total >= BUSY

``seq`` counts the skip-mode saves. Rank 0 deletes ``seq - 2``'s keys: every rank added to
``seq - 1`` before ``seq`` could complete, so has read them.
"""

from __future__ import annotations

import itertools
import json
import time
from typing import Any, Callable, Iterable

from ..errors import CheckpointNotFound, ConfigError, DistributedError, StateMismatchError, ZerostallError
from .session import Session
from .store import Store

__all__ = ["PeerFailed", "agree_room", "agree_step", "agreed_load"]


class PeerFailed(DistributedError):
    """Raised by the gate: another rank could not load the agreed step (state dict unchanged)."""


def _gather(store: Store, base: str, rank: int, world: int, value: Any, timeout_s: float, what: str) -> list[Any]:
    """Post ``value`` as ``<base>/r<rank>``, return every rank's (bounded: ``timeout_s`` + 1 s)."""
    deadline = time.monotonic() + timeout_s
    with store.bounded(deadline + 1.0):
        store.set(f"{base}/r{rank}", json.dumps(value))
        vals = store.gather(base, range(world), deadline, lambda who: (
            f"{who} did not {what} within {timeout_s:g} s (every rank must call load() together; pass "
            "agree=False to load alone)"))
        if store.add(f"{base}/n", 1) == world:
            store.delete(*(f"{base}/r{r}" for r in range(world)), f"{base}/n")
    return vals


def agree_step(store: Store, base: str, rank: int, world: int, candidates: Iterable[int], *,
               timeout_s: float = 600.0, history: list[str] | None = None) -> int:
    """Round 1, collective: the newest step in every rank's ``candidates``. Raises the same
    :class:`CheckpointNotFound` on every rank when there is none, naming the ranks and steps
    (``history``: the earlier failures, identical on every rank)."""
    mine = sorted({int(s) for s in candidates})
    sets = _gather(store, f"{base}/c", rank, world, mine, timeout_s, "offer the steps it can load")
    if common := set.intersection(*map(set, sets)):
        return max(common)
    every = sorted(set().union(*map(set, sets)), reverse=True)[:5]
    lines = [f"step {s}: missing on rank(s) {', '.join(str(r) for r in range(world) if s not in sets[r])}"
             for s in every]
    raise CheckpointNotFound("no step that every rank can load: " + "; ".join((history or []) + lines) +
                             ("" if every or history else " (no rank has a committed step)"))


def agreed_load(store: Store, base: str, rank: int, world: int, candidates: Iterable[int],
                load_one: Callable[[int, Callable[[], None]], Any], *, timeout_s: float = 600.0,
                report: Any = None, fallback: bool = True) -> Any:
    """Rounds 1-3. ``load_one(step, gate)`` loads ``step``, calling ``gate()`` once every byte
    verified and before the caller's state changes; ``report`` (a ``LoadReport``) gets ``why``."""
    left = {int(s) for s in candidates}
    history: list[str] = []
    for i in itertools.count():  # ends: each round drops a step, and none left raises
        if history and not fallback:
            raise CheckpointNotFound("the newest step every rank could load failed and fallback=False: "
                                     + "; ".join(history))
        step = agree_step(store, f"{base}/a{i}", rank, world, left, timeout_s=timeout_s, history=history)
        outcomes: list[Any] = []

        def post(outcome: dict[str, Any], okey: str = f"{base}/a{i}/o") -> None:
            outcomes.extend(_gather(store, okey, rank, world, outcome, timeout_s, "load the agreed step"))

        def gate() -> None:
            post({"ok": True})
            if bad := [(r, o) for r, o in enumerate(outcomes) if not o["ok"]]:
                raise PeerFailed("; ".join(f"rank {r}: {o['error']}" for r, o in bad))

        try:
            out = load_one(step, gate)
        except PeerFailed:
            pass
        except DistributedError:
            raise
        except (StateMismatchError, ConfigError) as exc:
            post({"ok": False, "fatal": True, "error": str(exc)})
            raise
        except ZerostallError as exc:
            if not outcomes:
                post({"ok": False, "error": str(exc)})
        else:
            if report is not None:
                report.why = (f"step {step}: the newest step all {world} ranks can load"
                              + (f" (newer ones failed: {'; '.join(history)})" if history else ""))
            return out
        bad = [(r, o) for r, o in enumerate(outcomes) if not o["ok"]]
        for r, o in bad:
            if o.get("fatal"):
                raise DistributedError(f"rank {r} cannot load step {step} into its state dict: {o['error']}")
        history.append(f"step {step} failed on " + ", ".join(f"rank {r} ({o['error']})" for r, o in bad))
        left.discard(step)


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
