"""The cross-rank commit of one step: a written state machine, through the c10d store.

Called on each rank's persist thread, at a different moment on every rank: hence the store,
never a collective (why, and what the commit guarantees: docs/distributed.md). Keys of the
round of step N live under ``<ns>/<sid>/s<N>/`` (:mod:`.session`), never under a per-process
counter, so a rank that failed or skipped a step cannot shift later steps' keys.

**The decision is the only truth**: ``decision`` is written once, by ``compare_set`` against
"absent"; rank 0 writes ``commit``, any rank ``abort``; nothing is renamed into ``step-N``
before a commit, nothing deleted before an abort. **One deadline per round**: the first
rank in sets ``t0`` (wall clock: the nodes' clocks must agree to well within the timeout) and
``d``, its lead since it began the step's persist (``b/r<R>``, :func:`post_begin`); a lagging
rank that began the step later earns one move of the deadline (:func:`_extended`). **Every wait
a deadline**: every request runs inside :meth:`.store.Store.bounded`. The bounds, graces and
why: docs/deadlines.md and docs/distributed.md.

States of one rank (C: coordinator only, P: the others; ``->`` on an event)::

    WRITING   shard written + fdatasync'ed          -> REPORTED (P sets r<R>; C keeps its own)
              local failure / skip                  -> ABORTING (sets decision=abort{rank, error})
    REPORTED  C: all r<R> present                   -> PREPARED (merge; manifest/<group> keys set)
              C: merge fails (structure, shapes)    -> ABORTING
              decision present                      -> DECIDED
              deadline (P: + grace) passed          -> ABORTING (abort{missing ranks: those without r<R>})
    PREPARED  C: compare_set(decision, commit)      -> DECIDED  (ours, or the abort that came first)
    ABORTING  compare_set(decision, abort)          -> DECIDED  (ours, or whatever came first)
    DECIDED   commit, rank leads its copy           -> RECORDING
              commit, not the leader                -> waits for done/<group> until deadline + grace,
                                                       then RECORDING itself (the leader is stopped)
              abort                                 -> FAILED   (deletes its own shard; the leader
                                                       removes the empty partial directory)
    RECORDING the decided manifest into step-N.partial/manifest.decided (tmp + rename, fsync
              the directory): the copy's record of the decision; sets rec/<group>
                                                    -> RECORDED once every copy's rec/<group> is set
                                                       (until deadline + grace; a copy missing or
                                                       failing then: this copy still FINISHES, but
                                                       its ranks report UNKNOWN, never durable)
    RECORDED  (fault point ``recorded``)
              rename manifest.decided -> manifest.json, fsync, rename step-N.partial -> step-N,
              fsync root; idempotent: a copy another rank renamed with this checkpoint id is done
                                                    -> DURABLE  (sets done/<group>)
    any       the store does not answer in time     -> UNKNOWN  (nothing deleted)
    DURABLE, FAILED, UNKNOWN: add 1 to ``ack``; the rank completing the count deletes the
    round's keys. Rank 0 (which may host the store) waits, at close(), until the rounds it
    committed were acknowledged by every rank (bounded), so leaving its ``with`` block does
    not take the store away from a rank that has yet to read a commit.

A handle says durable only after DURABLE, failed only after an abort decision, and
:class:`OutcomeUnknown` when the store stopped answering first (docs/distributed.md).
The disk side of a copy (RECORDING, the renames, what a crash leaves) is :mod:`.finish`.
"""

from __future__ import annotations

import contextlib
import json
import logging
import time
from typing import Any, Callable, Iterator

from ..errors import DistributedError, SaveFailed, ZerostallError
from ..store.local import LocalTier
from .finish import finish_copy, record_decision
from .merge import manifests, merge, peer_protected
from .session import Session
from .store import Store, StoreTimeout

__all__ = ["OutcomeUnknown", "commit_round", "merge", "peer_protected", "report_failure"]

log = logging.getLogger("zerostall")

fault_hook: Callable[[str, int, int], None] | None = None
"""Test seam: ``fault_hook(point, rank, step)`` at each named point of a round (``persist``,
``begin``, ``entered``, ``reported``, ``prepared``, ``decided``, ``finished``, ``acked``)."""


class OutcomeUnknown(DistributedError):
    """This rank could not learn the round's decision (the store stopped answering): the step
    may still be committed by the coordinator; nothing of it was deleted here."""


def fault_point(name: str, session: Session, step: int) -> None:
    """Call :data:`fault_hook`, if set."""
    if fault_hook is not None:
        fault_hook(name, session.rank, step)


def step_base(session: Session, step: int) -> str:
    return f"{session.prefix}/s{step}"


def grace_s(timeout_s: float) -> float:
    """How long a copy's other ranks wait past the deadline for its leader to finish it."""
    return min(max(1.0, timeout_s / 4), 10.0)


def _deadline(store: Store, base: str, timeout_s: float, began: float | None) -> tuple[float, float]:
    """The round's deadline (monotonic, this rank) and the first rank's lead ``d``."""
    now = time.time()
    mine = json.dumps({"t0": now, "d": max(0.0, now - began) if began is not None else 0.0})
    got = json.loads(store.compare_set(f"{base}/t0", "", mine))
    return time.monotonic() + (float(got["t0"]) + timeout_s - now), float(got["d"])


def post_begin(store: Store, session: Session, step: int) -> float:
    """Post when this rank's persist thread picked ``step`` up (``b/r<R>``, best effort, bounded);
    returns that wall time, :func:`commit_round`'s ``began``."""
    now = time.time()
    try:
        with store.bounded(time.monotonic() + 1.0):
            store.set(f"{step_base(session, step)}/b{session.rank}", repr(now))
    except DistributedError as exc:
        log.debug("zerostall: step %d: could not post the start of its persist: %s", step, exc)
    return now


def _extended(store: Store, base: str, ranks: list[int], d: float, timeout_s: float, deadline: float) -> float | None:
    """At the deadline: the later deadline (monotonic) a rank that began the step after the
    first rank earns (its start + ``d`` + timeout), or None; a rank that never began moves nothing."""
    keys = [f"{base}/b{r}" for r in ranks]
    absent = set(store.missing(keys))
    began = store.multi_get_json([k for k in keys if k not in absent])
    if not began:
        return None
    latest = max(float(b) for b in began)
    later = time.monotonic() + (latest + d + timeout_s - time.time())
    return later if later > deadline + 0.05 else None


def _decide(store: Store, base: str, value: dict[str, Any], timeout: float) -> dict[str, Any]:
    return json.loads(store.compare_set(f"{base}/decision", "", json.dumps(value), timeout))


def _abort_late(store: Store, base: str, by: int, missing: list[int], step: int, timeout_s: float) -> dict[str, Any]:
    """ABORTING at the deadline: ``missing`` ranks did not report (none: the coordinator did not decide)."""
    who = (f"rank(s) {', '.join(map(str, missing))} did not report" if missing
           else "the coordinator (rank 0) did not decide")
    return _decide(store, base, {"commit": False, "by": by, "missing": missing or [0],
                                 "error": f"step {step}: {who} within commit_timeout_s={timeout_s:g} s (died, "
                                          "stopped, or not saving this step); nothing committed"}, grace_s(timeout_s))


def commit_round(store: Store, session: Session, fragment: dict[str, Any], tier: LocalTier, step: int, *,
                 per_rank: bool, timeout_s: float, overwrite: bool = False,
                 user_metadata: dict[str, Any] | None = None,
                 protect: Callable[[set[int]], None] | None = None, began: float | None = None) -> tuple[str, ...]:
    """One rank's part of the round (persist thread), REPORTED to DURABLE, returned or raised
    by the deadline plus two :func:`grace_s` whatever the store does. Returns the post-commit
    problems (the ``latest`` hint). Raises :class:`SaveFailed` (abort decided),
    :class:`OutcomeUnknown` (the store stopped answering) or :class:`DistributedError`.
    ``protect`` (copy leaders, incremental saves) gets the steps the fragments protect before
    this copy is committed; ``began``: :func:`post_begin`'s time."""
    base = step_base(session, step)
    known = False
    fault_point("begin", session, step)
    with store.bounded(time.monotonic() + timeout_s + grace_s(timeout_s)) as scope:
        try:
            deadline, lead = _deadline(store, base, timeout_s, began)
            scope.until = deadline + 2 * grace_s(timeout_s)
            fault_point("entered", session, step)
            if session.rank == 0:
                dec = _coordinate(store, session, base, fragment, step, per_rank, deadline, timeout_s,
                                  user_metadata or {}, lead, scope)
            else:
                dec = _await_decision(store, session, base, fragment, step, deadline, timeout_s, lead, scope)
            known = True
            fault_point("decided", session, step)
            if not dec["commit"]:
                raise SaveFailed(dec["error"], step=step) if not dec.get("missing") else DistributedError(
                    dec["error"], missing_ranks=tuple(dec["missing"]))
            if protect is not None and session.is_leader:
                protect(set(dec.get("protect", ())))
            post = _finish_mine(store, session, base, dec, tier, step, overwrite, deadline, timeout_s)
            fault_point("finished", session, step)
            return post
        except DistributedError as exc:
            if isinstance(exc, OutcomeUnknown) or known and not isinstance(exc, StoreTimeout):
                raise
            if known:
                raise OutcomeUnknown(f"step {step}: committed by the coordinator, but this rank could not confirm "
                                     f"its copy: {exc}") from exc
            raise OutcomeUnknown(f"step {step}: outcome unknown: {exc}; this rank deleted nothing, so the "
                                 "coordinator may still commit the step (the next collective load agrees on a step "
                                 "every rank can restore)") from exc
        finally:
            if known:
                ack(store, session, base)
                fault_point("acked", session, step)


def _await_decision(store: Store, session: Session, base: str, fragment: dict[str, Any], step: int,
                    deadline: float, timeout_s: float, lead: float, scope: Any) -> dict[str, Any]:
    """P: REPORTED -> DECIDED; returns the decision."""
    store.set(f"{base}/r{session.rank}", json.dumps(fragment))
    fault_point("reported", session, step)
    grace = grace_s(timeout_s)
    # the coordinator decides at the deadline: a grace for it before every rank looks for itself
    state = store.poll([f"{base}/decision"], deadline + grace)
    if state == "timeout":
        missing = store.missing_ranks(base, range(1, session.world), grace)
        later = _extended(store, base, [0] + missing, lead, timeout_s, deadline)
        if later is not None:
            scope.until = later + 2 * grace
            state = store.poll([f"{base}/decision"], later + grace)
            missing = store.missing_ranks(base, range(1, session.world), grace) if state == "timeout" else []
    if state == "timeout":
        dec = _abort_late(store, base, session.rank, missing, step, timeout_s)
    else:
        dec = store.get_json(f"{base}/decision")
    store.delete(f"{base}/r{session.rank}", f"{base}/b{session.rank}")
    return dec


def _coordinate(store: Store, session: Session, base: str, fragment: dict[str, Any], step: int, per_rank: bool,
                deadline: float, timeout_s: float, user_metadata: dict[str, Any], lead: float,
                scope: Any) -> dict[str, Any]:
    """C: REPORTED -> PREPARED -> DECIDED; returns the decision."""
    world, grace = session.world, grace_s(timeout_s)
    keys = [f"{base}/r{r}" for r in range(1, world)]
    state = store.poll(keys, deadline, abort=f"{base}/decision")
    if state == "timeout":
        later = _extended(store, base, store.missing_ranks(base, range(1, world), grace), lead, timeout_s, deadline)
        if later is not None:
            scope.until = later + 2 * grace
            deadline = later
            state = store.poll(keys, later, abort=f"{base}/decision")
    store.delete(f"{base}/b0")
    if state == "abort":
        return store.get_json(f"{base}/decision")
    if state == "timeout":
        missing = store.missing_ranks(base, range(1, world), grace)
        if missing:
            return _abort_late(store, base, 0, missing, step, timeout_s)
    try:
        frags = [fragment] + store.multi_get_json(keys)
        mans = manifests(frags, session.copies(), session.groups, step, world, per_rank, user_metadata)
    except ZerostallError as exc:
        return _decide(store, base, {"commit": False, "by": 0, "error": str(exc) if str(exc).startswith(
            f"step {step}") else f"step {step}: {exc}"}, grace)
    distinct: dict[bytes, str] = {}  # one key per distinct manifest (per_rank copies share one)
    names = {name: distinct.setdefault(raw, f"m{len(distinct)}") for name, raw in mans.items()}
    for raw, key in distinct.items():
        store.set(f"{base}/{key}", raw.decode())
    fault_point("prepared", session, step)
    kept = sorted(peer_protected(frags))
    return _decide(store, base, {"commit": True, "manifests": names, "protect": kept}, max(
        deadline - time.monotonic(), 0.0) + grace)


def _finish_mine(store: Store, session: Session, base: str, dec: dict[str, Any], tier: LocalTier, step: int,
                 overwrite: bool, deadline: float, timeout_s: float) -> tuple[str, ...]:
    """DECIDED(commit) -> DURABLE for this rank's copy."""
    done_key = f"{base}/done/{session.group}"
    if not session.is_leader:
        until = max(deadline, time.monotonic()) + grace_s(timeout_s)
        if store.poll([done_key], until) == "ok":
            done = store.get_json(done_key)
            if done.get("unknown"):
                raise OutcomeUnknown(done["error"])
            if not done["ok"]:
                raise SaveFailed(f"step {step}: the commit of its copy of the root on node "
                                 f"{session.nodes[session.leader] if session.nodes else '?'} failed: {done['error']}",
                                 step=step)
            return ()
        if overwrite:
            raise OutcomeUnknown(f"step {step}: committed by the coordinator, but rank {session.leader} did not "
                                 f"confirm the overwrite of its copy within {timeout_s:g} s (+ grace)")
        log.warning("zerostall: step %d: rank %d did not finish the copy of %s in time; rank %d finishes it",
                    step, session.leader, tier.root, session.rank)
    raw = store.get(f"{base}/{dec['manifests'][session.group]}")
    problems: list[str] = []
    if not overwrite:  # an overwrite records nothing (:mod:`.finish`)
        rec_key = f"{base}/rec/{session.group}"
        with _failure_posted(store, rec_key, done_key):
            record_decision(tier, step, raw)
        store.set(rec_key, json.dumps({"ok": True}))
        problems = _records(store, session, base, max(deadline, time.monotonic()) + grace_s(timeout_s))
        fault_point("recorded", session, step)
    with _failure_posted(store, done_key):
        post = finish_copy(tier, step, raw, overwrite=overwrite, leader=session.is_leader)
    if problems:
        err = (f"step {step}: committed by the coordinator and in this copy, but {'; '.join(problems)}: the "
               "step may be missing from that copy at the next start (the next collective load agrees on a step "
               "every rank can restore)")
        store.set(done_key, json.dumps({"ok": False, "unknown": True, "error": err}))
        raise OutcomeUnknown(err)
    store.set(done_key, json.dumps({"ok": True}))
    return post


@contextlib.contextmanager
def _failure_posted(store: Store, *keys: str) -> Iterator[None]:
    """Post what the block raises as ``{"ok": false, "error"}`` under each of ``keys``; re-raise."""
    try:
        yield
    except BaseException as exc:
        for k in keys:
            store.set(k, json.dumps({"ok": False, "error": str(exc)}))
        raise


def _records(store: Store, session: Session, base: str, until: float) -> list[str]:
    """RECORDING -> RECORDED: wait until every copy recorded the decision (or ``until``);
    returns the copies that did not, or failed to."""
    store.poll([f"{base}/rec/{g}" for g in session.groups], until)
    out = []
    for g in session.groups:
        where = f"the copy on node {session.nodes[int(g[1:])] if session.nodes else g} (rank {g[1:]})"
        if not store.check([f"{base}/rec/{g}"]):
            out.append(f"{where} did not record the decision in time")
        elif not (rec := store.get_json(f"{base}/rec/{g}")).get("ok"):
            out.append(f"{where} could not record it: {rec['error']}")
    return out


def ack(store: Store, session: Session, base: str) -> None:
    """This rank is finished with the round; the last one deletes the round's keys."""
    try:
        if store.add(f"{base}/ack", 1, 5.0) == session.world:
            store.delete(f"{base}/decision", f"{base}/t0", f"{base}/ack", *(f"{base}/m{i}" for i in
                         range(len(session.leaders))), *(f"{base}/done/{g}" for g in session.groups),
                         *(f"{base}/rec/{g}" for g in session.groups))
    except DistributedError as exc:  # the store may be gone with rank 0; the round's outcome stands
        log.error("zerostall: could not finish the round %s: %s", base, exc)


def report_failure(store: Store, session: Session, step: int, exc: BaseException) -> dict[str, Any] | None:
    """WRITING -> ABORTING -> DECIDED for a rank that failed locally (any thread; bounded).
    Returns the decision (None: the store did not answer)."""
    base = step_base(session, step)
    msg = f"step {step}: rank {session.rank} failed: {exc}; nothing committed"
    with store.bounded(time.monotonic() + 10.0):
        try:
            dec = _decide(store, base, {"commit": False, "by": session.rank, "error": msg}, 10.0)
        except DistributedError as sexc:
            log.error("zerostall: could not report the failure of step %d to the other ranks: %s", step, sexc)
            return None
        store.delete(f"{base}/r{session.rank}", f"{base}/b{session.rank}")
        ack(store, session, base)
    return dec


def wait_acked(store: Store, session: Session, steps: list[int], timeout_s: float) -> list[int]:
    """Rank 0 at close(): wait until every rank acknowledged the rounds of ``steps`` (their
    ``decision`` key is gone), at most ``timeout_s`` in all; returns the steps still open."""
    deadline = time.monotonic() + timeout_s
    open_ = list(steps)
    while open_ and time.monotonic() < deadline:
        try:
            open_ = [s for s in open_ if store.check([f"{step_base(session, s)}/decision"], 2.0)]
        except DistributedError:
            return open_
        if open_:
            time.sleep(0.02)
    return open_
