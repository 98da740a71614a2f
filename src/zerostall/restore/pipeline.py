"""Restore: find the newest committed checkpoint that verifies and load it (:func:`load`).

Caller's thread (``zerostall.load``, ``Checkpointer.load``, the CLI). Candidates newest first
(local copy, then the remote's), each by :func:`.step.load_step`; every defect of a checkpoint
is logged and falls back to the previous one, never a defect of the caller's
(:class:`StateMismatchError`, :class:`ConfigError`), and never leaves a failed step's bytes behind.

Readers take no lock (:mod:`zerostall.store.local`): an overwrite or retention may change a step
under ``load`` or ``verify``, which then sees a defect that is not one. The rule both share
(:func:`changed_under`, :func:`verify_consistent`): when reading a step fails, look at its
manifest again: gone, deleted meanwhile (not a failure); another identity, replaced meanwhile
(read it again, at most :data:`MAX_REPLACED` times); the same, the step's own failure.

Under a process group, :func:`collective_load`: every rank loads the newest step all can load
(the rounds: :mod:`zerostall.distributed.agree`).
"""

from __future__ import annotations

import contextlib
import logging
import os
from dataclasses import dataclass, field, replace
from typing import Any, Callable, Iterable, TypeVar

from ..config import IOConfig
from ..distributed.agree import agreed_load
from ..distributed.store import Store
from ..errors import (CheckpointNotFound, ConfigError, CorruptCheckpoint, DistributedError, RemoteError,
                      StateMismatchError, ZerostallError)
from ..io.base import Engine, choose_engine
from ..memory.arena import Arena
from ..store import open_root
from ..store.remote import list_steps
from ..store.local import LocalTier
from ..store.tier import is_url, open_tier
from .download import damaged_local_ref, fetch
from .state import LoadReport, LoadRequest, location_mapper
from .step import load_step, shared_bounce

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


def load(path: str, state_dict: Any = None, request: LoadRequest | None = None, *, engine: Engine | None = None,
         bounce: Arena | None = None, report: LoadReport | None = None) -> Any:
    """Load the newest verified checkpoint (or ``request.step``) under ``path``.

    A step only ``request.remote`` holds is downloaded into ``path`` first (``download=False``:
    streamed, nothing written). A step deleted meanwhile is not a failure. ``engine``,
    ``bounce``: the I/O engine and scratch (None: opened here). ``report`` gets the step
    loaded and the key report.
    """
    req = _checked(request if request is not None else LoadRequest())
    remote = req.remote
    listed, remote_why = list_steps(remote) if remote is not None else ([], "")
    remote_steps = listed or []
    report = report if report is not None else LoadReport()
    if is_url(path):
        raise ConfigError(f"load({path!r}): the path is a local directory; pass the URL as remote= to "
                          "load from it (its steps are downloaded into the directory)")
    tier: LocalTier = open_root(path, create=False)  # type: ignore[assignment]  # a plain path
    if remote is not None and not os.path.isdir(tier.root):
        tier = open_root(path, create=True)  # type: ignore[assignment]
    own_engine = engine is None
    bounce = bounce or shared_bounce()
    walk = _Fallback(tier, remote, remote_steps, req.step, req.fallback)
    try:
        while (candidate := walk.next()) is not None:
            s, src = candidate
            if engine is None:
                engine = choose_engine(tier.root, req.io or IOConfig())
            ident = walk.ident(s, src)
            fetched = False
            try:
                if src == "remote" and req.download:
                    fetched = fetch(tier, remote, s, walk.seen_local.get(s), who=(req.rank, req.world_size))[1]
                out = load_step(remote if src == "remote" and not req.download else tier, s, engine, bounce,
                                state_dict, req, report=report)
            except (StateMismatchError, ConfigError, DistributedError):
                raise  # the caller's state or arguments, or the ranks' agreement (gate): not this copy's defect
            except Exception as exc:  # noqa: BLE001 - every defect of a checkpoint means: try the previous one
                walk.failed(s, src, ident, fetched, exc)
                continue
            report.step, report.source, report.failed = s, src, list(walk.errors)
            _log_loaded(report, tier.root)
            return out
        raise walk.error(state_dict, remote_why)
    finally:
        if own_engine and engine is not None:
            engine.close()


def _checked(req: LoadRequest) -> LoadRequest:
    """``req`` with its remote opened and ``keys`` a list; a bad ``keys`` or ``map_location``
    raises :class:`ConfigError` before anything is read."""
    remote, keys = req.remote, req.keys
    if isinstance(remote, str):
        remote = open_tier(remote, io=req.io)
    if keys is not None:
        if isinstance(keys, str) or not all(isinstance(k, str) for k in keys):
            raise ConfigError(f"keys={keys!r} must be a list of str (dotted key paths)")
        keys = list(keys)
    location_mapper(req.map_location)
    return replace(req, remote=remote, keys=keys)


@dataclass
class _Fallback:
    """One load's walk over the candidate copies, newest first, local before remote: which were
    tried, which failed and why (a copy changed under the read is tried again)."""

    tier: LocalTier
    remote: Any
    remote_steps: list[int]
    step: int | None
    fallback: bool
    tried: set[tuple[int, str]] = field(default_factory=set)
    replaced: dict[int, int] = field(default_factory=dict)
    refetched: set[int] = field(default_factory=set)
    seen_local: dict[int, Any] = field(default_factory=dict)
    errors: list[str] = field(default_factory=list)
    part_loaded: bool = False

    def next(self) -> tuple[int, str] | None:
        """The next (step, "local" | "remote") to try, from a fresh listing; None when done."""
        steps = self.tier.listed_steps()  # damaged ones too: each is tried and its defect reported
        every = sorted({s for s in set(steps) | set(self.remote_steps) if self.step in (None, s)}, reverse=True)
        todo = [(s, src) for s in every for src, have in (("local", steps), ("remote", self.remote_steps))
                if s in have and (s, src) not in self.tried]
        if not todo or (self.errors and not self.fallback):
            return None
        self.tried.add(todo[0])
        return todo[0]

    def ident(self, s: int, src: str) -> Any:
        """The identity of the copy about to be read (to tell a change under the read)."""
        if src == "local":
            ident = self.seen_local[s] = self.tier.manifest_ident(s)
            return ident
        with contextlib.suppress(Exception):  # a remote that cannot be listed: its failure is the step's own
            return self.remote.manifest_ident(s)
        return None

    def failed(self, s: int, src: str, ident: Any, fetched: bool, exc: Exception) -> None:
        """Copy (``s``, ``src``) raised ``exc`` (``fetched``: this load downloaded it): tried
        again if it changed under the read or borrows from a damaged local base, else recorded."""
        tier, remote = self.tier, self.remote
        why = changed_under(remote if src == "remote" else tier, s, ident, remote=src == "remote")
        if why is not None and fetched:
            tier.delete(s)  # our download of the remote copy that was replaced (or removed) meanwhile
        if why == GONE:
            log.info("zerostall: step %d disappeared while loading (retention?); listing again", s)
            return
        if why == REPLACED and self.replaced.get(s, 0) < MAX_REPLACED:
            # the writer overwrote this step while we read it (old manifest, new shard): read it again
            self.replaced[s] = self.replaced.get(s, 0) + 1
            self.tried.discard((s, src))
            log.info("zerostall: step %d was overwritten while loading; reading it again", s)
            return
        bad_ref = damaged_local_ref(tier, s, exc) if fetched and s not in self.refetched else None
        if bad_ref is not None and bad_ref in self.remote_steps:
            self.refetched.add(s)
            log.warning("zerostall: step %d borrows from local step %d, which is damaged (%s); "
                        "fetching step %d from the remote again", s, bad_ref, exc, bad_ref)
            try:
                fetch(tier, remote, bad_ref)
                self.tried.discard((s, src))
                return
            except Exception as fexc:  # noqa: BLE001 - reported below with the original defect
                log.error("zerostall: fetching step %d again failed: %s", bad_ref, fexc)
        reason = str(exc) if isinstance(exc, ZerostallError) else f"{type(exc).__name__}: {exc}"
        self.part_loaded = self.part_loaded or getattr(exc, "part_loaded", False)
        log.error("zerostall: step %d (%s copy) failed: %s", s, src, reason)
        self.errors.append(f"step {s} ({src}): {reason}")
        if fetched and isinstance(exc, CorruptCheckpoint):
            tier.delete(s)  # drop the bad download (a failed fetch committed nothing: a local copy stays)

    def error(self, state_dict: Any, remote_why: str) -> ZerostallError:
        """What a load that ran out of candidates raises."""
        tier, remote = self.tier, self.remote
        if self.errors:
            return CorruptCheckpoint(f"no checkpoint in {tier.root!r} verifies: " + "; ".join(self.errors) +
                                     ("" if state_dict is None else " The state dict is part loaded: load a step "
                                      "into it again." if self.part_loaded else " The state dict was not modified."),
                                     path=tier.root, part_loaded=self.part_loaded)
        if remote_why and not self.tried:
            return RemoteError(f"no committed checkpoint in {tier.root!r}, and the remote tier could not be "
                               f"listed: {remote_why}", url=remote.url)
        where = f"{tier.root!r}" + (f" or {remote.url}" if remote is not None else "")
        if self.step is not None:
            return CheckpointNotFound(f"no committed checkpoint for step {self.step} in {where} "
                                      f"(steps: {sorted(set(tier.listed_steps()) | set(self.remote_steps)) or 'none'})")
        parts = tier.partial_steps()
        extra = f" ({len(parts)} unfinished .partial directories)" if parts else ""
        return CheckpointNotFound(f"no committed checkpoint in {where}{extra}")


def _log_loaded(report: LoadReport, root: str) -> None:
    s, src, errors = report.step, report.source, report.failed
    if errors:
        log.warning("zerostall: loaded step %d (%s) after newer copies failed: %s", s, src, "; ".join(errors))
    else:
        log.info("zerostall: loaded step %d from %s (%s)", s, root, src)
    if report.missing_keys:
        log.warning("zerostall: step %d lacks %d keys of the state dict (left unchanged): %s", s,
                    len(report.missing_keys), ", ".join(report.missing_keys[:10]))
    if report.unexpected_keys:
        log.info("zerostall: step %d holds %d keys the state dict lacked (added): %s", s,
                 len(report.unexpected_keys), ", ".join(report.unexpected_keys[:10]))


_calls: dict[str, int] = {}


def collective_base(ns: str) -> str:
    """A key base for this process's next collective load under ``ns`` (every rank counts alike)."""
    n = _calls[ns] = _calls.get(ns, 0) + 1
    return f"{ns}/load{n}"


def collective_load(store: Store, base: str, rank: int, world: int, path: str, state_dict: Any,
                    request: LoadRequest, *, report: Any = None, timeout_s: float = 600.0,
                    extra_steps: Iterable[int] = (), exclude_steps: Iterable[int] = (),
                    prepare: Callable[[int], None] | None = None, engine: Any = None, bounce: Any = None) -> Any:
    """``zerostall.restore.load`` on every rank of a group, agreeing on one step. Called by
    ``Checkpointer.load`` and ``zerostall.load`` (caller's thread, collectively). ``request``:
    what to load (``fallback`` applies across the agreed steps; its ``rank``, ``world_size``
    and ``gate`` are set here). ``extra_steps``: more steps this rank can load (peer replicas);
    ``exclude_steps``: steps not to offer; ``prepare(step)`` runs before each step's load (what
    it raises fails that step on this rank, and every rank falls back together)."""
    report = report if report is not None else LoadReport()
    cands = set(open_root(path).listed_steps()) if os.path.isdir(path) else set()
    if isinstance(request.remote, str):  # keys, map_location: load() checks them, inside the agreement
        request = replace(request, remote=open_tier(request.remote, io=request.io))
    if request.remote is not None:
        cands |= set(list_steps(request.remote)[0] or [])
    cands = {s for s in cands | set(map(int, extra_steps)) if request.step in (None, s)} - set(map(int, exclude_steps))

    def one(s: int, gate: Callable[[], None]) -> Any:
        if prepare is not None:
            prepare(s)
        req = replace(request, step=s, gate=gate, rank=rank, world_size=world, fallback=True)
        return load(path, state_dict, req, engine=engine, bounce=bounce, report=report)
    return agreed_load(store, base, rank, world, sorted(cands), one, timeout_s=timeout_s, report=report,
                       fallback=request.fallback)
