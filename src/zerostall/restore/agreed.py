"""Restore, agreed across ranks: every rank of a group loads the newest step all can load
(the rounds: :mod:`zerostall.distributed.agree`).
"""

from __future__ import annotations

import os
from dataclasses import replace
from typing import Any, Callable, Iterable

from ..distributed.agree import agreed_load
from ..distributed.store import Store
from ..store.remote import list_steps
from ..store.tier import open_tier
from ..store import open_root
from .pipeline import LoadRequest, load
from .state import LoadReport

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
    remote = request.remote
    if isinstance(remote, str):
        remote = open_tier(remote, io=request.io)
    if remote is not None:
        cands |= set(list_steps(remote)[0] or [])
    cands = {s for s in cands | {int(s) for s in extra_steps} if request.step in (None, s)}
    cands -= {int(s) for s in exclude_steps}

    def one(s: int, gate: Callable[[], None]) -> Any:
        if prepare is not None:
            prepare(s)
        req = replace(request, step=s, remote=remote, gate=gate, rank=rank, world_size=world, fallback=True)
        return load(path, state_dict, req, engine=engine, bounce=bounce, report=report)
    return agreed_load(store, base, rank, world, sorted(cands), one, timeout_s=timeout_s, report=report,
                       fallback=request.fallback)
