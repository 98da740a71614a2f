"""One step for all ranks: agreeing, through the c10d store, on the step every rank restores.

Who calls what: :func:`zerostall.restore.agreed.collective_load` (caller's thread, every rank
of the group, collectively) calls :func:`agreed_load`, under a key ``base`` it makes unique
per collective call.

The rounds of :func:`agreed_load`, until one succeeds or no candidate is left:

1. :func:`agree_step`: every rank posts the steps it may load (``c/r<R>``); each takes the
   newest step in the intersection. None: every rank raises the same
   :class:`CheckpointNotFound`, naming which ranks lack which steps and what failed before;
2. every rank loads that step into scratch (every byte it needs verified) and, before its
   state dict changes, posts its outcome (``o/r<R>``: ok, or the error naming the file) and
   waits for everyone's (the *gate*);
3. all ok: every rank applies the step. Any failure: every rank drops the step (a rank that
   had loaded it leaves its state dict untouched) and goes back to 1 without it.

A failure of the caller's own state dict (:class:`StateMismatchError`, :class:`ConfigError`)
ends the agreement on every rank: that rank re-raises it, the others raise
:class:`DistributedError` naming it.
"""

from __future__ import annotations

import itertools
import json
import time
from typing import Any, Callable, Iterable

from ..errors import CheckpointNotFound, ConfigError, DistributedError, StateMismatchError, ZerostallError
from .store import Store

__all__ = ["PeerFailed", "agree_step", "agreed_load"]


class PeerFailed(DistributedError):
    """Another rank could not load the agreed step: this rank's load of it is abandoned
    (raised by the gate, before the state dict changes)."""


def _gather(store: Store, base: str, rank: int, world: int, value: Any, timeout_s: float, what: str) -> list[Any]:
    """Post ``value`` as ``<base>/r<rank>`` and return every rank's; the last reader deletes them.
    Every request ends by ``timeout_s`` plus a second, whatever the store does."""
    deadline = time.monotonic() + timeout_s
    with store.bounded(deadline + 1.0):
        store.set(f"{base}/r{rank}", json.dumps(value))
        keys = [f"{base}/r{r}" for r in range(world)]
        if store.poll(keys, deadline) == "timeout":
            missing = [int(k.rsplit("/r", 1)[1]) for k in store.missing(keys)]
            raise DistributedError(f"rank(s) {', '.join(map(str, missing))} did not {what} within {timeout_s:g} s "
                                   "(every rank must call load() together; pass agree=False to load alone)",
                                   missing_ranks=tuple(missing))
        vals = store.multi_get_json(keys)
        if store.add(f"{base}/n", 1) == world:
            store.delete(*keys, f"{base}/n")
    return vals


def agree_step(store: Store, base: str, rank: int, world: int, candidates: Iterable[int], *,
               timeout_s: float = 600.0, history: list[str] | None = None) -> int:
    """The newest step in every rank's ``candidates`` (module docstring, round 1). Collective:
    every rank calls it with the same ``base``. Raises the same :class:`CheckpointNotFound` on
    every rank when the intersection is empty (naming the ranks and steps; ``history``: lines
    about steps that failed earlier, identical on every rank)."""
    mine = sorted({int(s) for s in candidates})
    sets = _gather(store, f"{base}/c", rank, world, mine, timeout_s, "offer the steps it can load")
    common = set(sets[0]).intersection(*map(set, sets[1:])) if sets else set()
    if common:
        return max(common)
    every = sorted(set().union(*map(set, sets)), reverse=True)[:5]
    lines = [f"step {s}: missing on rank(s) {', '.join(str(r) for r in range(world) if s not in sets[r])}"
             for s in every]
    raise CheckpointNotFound("no step that every rank can load: " + "; ".join((history or []) + lines) +
                             ("" if every or history else " (no rank has a committed step)"))


def agreed_load(store: Store, base: str, rank: int, world: int, candidates: Iterable[int],
                load_one: Callable[[int, Callable[[], None]], Any], *, timeout_s: float = 600.0,
                report: Any = None, fallback: bool = True) -> Any:
    """Rounds 1-3 (module docstring). ``load_one(step, gate)`` loads ``step`` and calls ``gate()``
    once every byte verified, before anything reaches the caller's state; ``report`` (a
    ``LoadReport``) gets ``why``."""
    left = {int(s) for s in candidates}
    history: list[str] = []
    for i in itertools.count():  # ends: each round drops a step, and none left raises
        if history and not fallback:
            raise CheckpointNotFound("the newest step every rank could load failed and fallback=False: "
                                     + "; ".join(history))
        step = agree_step(store, f"{base}/a{i}", rank, world, left, timeout_s=timeout_s, history=history)
        okey = f"{base}/a{i}/o"
        outcomes: list[Any] = []

        def gate(okey: str = okey) -> None:
            outcomes.extend(_gather(store, okey, rank, world, {"ok": True}, timeout_s, "load the agreed step"))
            bad = [(r, o) for r, o in enumerate(outcomes) if not o["ok"]]
            if bad:
                raise PeerFailed("; ".join(f"rank {r}: {o['error']}" for r, o in bad))

        try:
            out = load_one(step, gate)
        except PeerFailed:
            pass
        except DistributedError:
            raise
        except (StateMismatchError, ConfigError) as exc:
            _gather(store, okey, rank, world, {"ok": False, "fatal": True, "error": str(exc)}, timeout_s,
                    "load the agreed step")
            raise
        except ZerostallError as exc:
            if not outcomes:
                outcomes.extend(_gather(store, okey, rank, world, {"ok": False, "error": str(exc)}, timeout_s,
                                        "load the agreed step"))
        else:
            if report is not None:
                report.why = (f"step {step}: the newest step all {world} ranks can load"
                              + (f" (newer ones failed: {'; '.join(history)})" if history else ""))
            return out
        fatal = [(r, o) for r, o in enumerate(outcomes) if o.get("fatal")]
        if fatal:
            r, o = fatal[0]
            raise DistributedError(f"rank {r} cannot load step {step} into its state dict: {o['error']}")
        bad = [(r, o) for r, o in enumerate(outcomes) if not o["ok"]]
        history.append(f"step {step} failed on " + ", ".join(f"rank {r} ({o['error']})" for r, o in bad))
        left.discard(step)
