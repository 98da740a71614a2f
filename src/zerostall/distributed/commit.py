"""The cross-rank commit of one step, through the c10d store (never the training's group).

Why the store and not a gloo group: the commit runs on each rank's persist thread, at a
different moment on every rank. Store requests are independent, safe from any thread and
bounded by our own deadlines; a collective would have to be entered by every rank in the
same order, and one rank that failed, skipped or died would leave the others inside it.

Rounds are keyed by (root, step) — ``<ns>/<sid>/s<step>/`` where ``ns`` names the root and
``sid`` the session agreed at start-up (:mod:`.session`) — never by a per-process counter, so
a rank that failed or skipped a step cannot shift the keys of later steps. The round of
step N:

1. every rank writes ``step-N.partial/rank-R.shard`` and fdatasyncs it;
2. rank ``R > 0`` sets ``r<R>`` = its fragment (file entry, tensor entries with crc32c, tree);
   a rank that failed locally — in ``save()`` before anything was queued, while writing, or
   by skipping — sets ``fail`` = ``{rank, error}`` instead (rank 0 sets ``result`` directly);
3. rank 0 (the coordinator) polls until every ``r*`` key exists, ``fail`` exists (the step
   fails at once on every rank) or ``commit_timeout_s`` passes (the missing ranks are named);
   if all are durable it merges the fragments into one manifest and runs the local tier's
   commit (manifest, fsync, rename, fsync, latest);
4. rank 0 sets ``result`` = ``{"commit": true}`` or ``{"commit": false, "error": ...}``; the
   others poll for it (same timeout), delete their own ``r<R>``, and on a node-local root each
   host's leader renames its own copy and sets ``done/<host>`` for the others of its host;
5. every rank adds 1 to ``ack`` once it is finished with the round (a rank that failed
   locally does so when it reports); the rank that completes the count deletes ``result``,
   ``fail``, ``ack`` and ``done/*``. Keys of a round stay behind only when a rank died.

A rank that dies before reporting never reports: rank 0 times out, publishes the failure and
removes the partial directory; nobody commits. If rank 0 dies, the others time out waiting
for ``result`` and fail their handles; nothing was renamed, so nothing is committed.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import time
from typing import Any, Callable

from ..errors import DistributedError, SaveFailed
from ..format.manifest import FileEntry, Manifest, TensorEntry
from ..format.refs import RefFile
from ..format.tree import remap_tree
from ..staging.incremental import RefTracker, merged_entries
from ..staging.job import Persisted, SaveRequest
from ..store.local import LocalTier
from ..store.committer import file_entry, tensor_entries
from .session import Session, Store

log = logging.getLogger("zerostall")


def merge(fragments: list[dict[str, Any]], step: int, world: int, per_rank: bool,
          user_metadata: dict[str, Any]) -> Manifest:
    """One manifest from every rank's fragment (rank order)."""
    files = tuple(FileEntry(**f["file"]) for f in fragments)
    ref_files: dict[tuple[int, str], RefFile] = {}
    for f in fragments:  # incremental saves: each rank borrows from its own earlier files
        for r in f.get("ref_files", ()):
            ref_files.setdefault((r["step"], r["name"]), RefFile(**r))
    if per_rank:
        tensors: list[TensorEntry] = []
        trees = []
        for f in fragments:
            base = len(tensors)
            local = {g: i for i, (g, _) in enumerate(f["tensors"])}
            tensors.extend(TensorEntry(**{**e, "shape": tuple(e["shape"])}) for _, e in f["tensors"])
            trees.append(remap_tree(f["tree"], lambda g, local=local, base=base: base + local[g]))
        tree, rank_trees = trees[0], tuple(trees)
    else:
        ref = fragments[0]["structure"]
        for r, f in enumerate(fragments):
            if f["structure"] != ref:
                raise SaveFailed(f"rank {r}'s state differs in structure from rank 0's; replicated mode needs "
                                 "identical state dicts on every rank (use dist_mode='per_rank')", step=step)
        n = fragments[0]["n_tensors"]
        slots: list[TensorEntry | None] = [None] * n
        for f in fragments:
            for g, e in f["tensors"]:
                slots[g] = TensorEntry(**{**e, "shape": tuple(e["shape"])})
        if any(s is None for s in slots):
            raise SaveFailed(f"step {step}: some tensors were written by no rank", step=step)
        tensors, tree, rank_trees = slots, fragments[0]["tree"], None  # type: ignore[assignment]
    return Manifest(step=step, world_size=world, checkpoint_id=fragments[0]["file"]["file_id"],
                    created_unix=time.time(), files=files, tensors=tuple(tensors), tree=tree,
                    user_metadata=user_metadata, rank_trees=rank_trees, ref_files=tuple(ref_files.values()))


def peer_protected(fragments: list[dict[str, Any]]) -> set[int]:
    """Steps any rank's incremental base or save in flight may reference (``RefTracker.protected``
    at the time the rank reported): the retention of the rank(s) that delete must keep them."""
    return {int(s) for f in fragments for s in f.get("protect", ())}


def commit_round(store: Store, session: Session, fragment: dict[str, Any], tier: LocalTier, step: int, *,
                 per_rank: bool, timeout_s: float, overwrite: bool = False,
                 user_metadata: dict[str, Any] | None = None,
                 protect: Callable[[set[int]], None] | None = None) -> None:
    """Steps 2-5 of the protocol for one rank (persist thread). Raises :class:`SaveFailed` or
    :class:`DistributedError` if nothing was committed. ``protect`` (incremental saves; rank 0
    and node-local leaders, the ranks that run retention) receives :func:`peer_protected` of
    the round's fragments before the commit."""
    base = step_base(session, step)
    deadline = time.monotonic() + timeout_s
    try:
        if session.rank == 0:
            res = _coordinate(store, session, base, fragment, tier, step, per_rank=per_rank, deadline=deadline,
                              timeout_s=timeout_s, overwrite=overwrite, user_metadata=user_metadata or {},
                              protect=protect)
        else:
            store.set(f"{base}/r{session.rank}", json.dumps(fragment))
            if store.poll([f"{base}/result"], deadline) == "timeout":
                store.delete(f"{base}/r{session.rank}")
                raise DistributedError(f"step {step}: the coordinator (rank 0) published no result within "
                                       f"commit_timeout_s={timeout_s:g} s; nothing committed", missing_ranks=(0,))
            res = store.get_json(f"{base}/result")
            store.delete(f"{base}/r{session.rank}")
        if not res["commit"]:
            raise SaveFailed(res["error"], step=step)
        if session.node_local:
            if protect is not None and session.rank in session.leaders and session.rank != 0:
                protect(set(res.get("protect", ())))
            _commit_node_copy(store, session, base, res, tier, step, overwrite, deadline, timeout_s)
    except DistributedError as exc:
        if str(exc).startswith(f"step {step}:"):
            raise
        raise DistributedError(f"step {step}: {exc}", missing_ranks=exc.missing_ranks) from exc
    finally:
        ack(store, session, base)


def step_base(session: Session, step: int) -> str:
    return f"{session.prefix}/s{step}"


def ack(store: Store, session: Session, base: str) -> None:
    """Step 5: this rank is finished with the round; the last one deletes the round's keys."""
    try:
        if store.add(f"{base}/ack", 1) == session.world:
            store.delete(f"{base}/result", f"{base}/fail", f"{base}/ack",
                         *(f"{base}/done/{h}" for h in session.hosts))
    except DistributedError as exc:  # the store may be gone with rank 0; the round's outcome stands
        log.error("zerostall: could not finish the round %s: %s", base, exc)


def report_failure(store: Store, session: Session, step: int, exc: BaseException) -> None:
    """Step 2 for a rank that failed locally: non-blocking (two store requests), any thread."""
    base = step_base(session, step)
    msg = f"step {step}: rank {session.rank} failed: {exc}; nothing committed"
    try:
        if session.rank == 0:
            store.set(f"{base}/result", json.dumps({"commit": False, "error": msg}))
        else:
            store.set(f"{base}/fail", json.dumps({"rank": session.rank, "error": msg}))
    except DistributedError as sexc:
        log.error("zerostall: could not report the failure of step %d to the other ranks: %s", step, sexc)
    ack(store, session, base)


def _coordinate(store: Store, session: Session, base: str, fragment: dict[str, Any], tier: LocalTier, step: int,
                *, per_rank: bool, deadline: float, timeout_s: float, overwrite: bool,
                user_metadata: dict[str, Any],
                protect: Callable[[set[int]], None] | None = None) -> dict[str, Any]:
    world = session.world
    keys = [f"{base}/r{r}" for r in range(1, world)]
    try:
        state = store.poll(keys, deadline, abort=f"{base}/fail")
        if state == "timeout":
            missing = [int(k.rsplit("/r", 1)[1]) for k in store.missing(keys)]
            raise DistributedError(f"step {step}: rank(s) {', '.join(map(str, missing))} did not report within "
                                   f"commit_timeout_s={timeout_s:g} s (died, stuck, or not saving this step); "
                                   "nothing committed", missing_ranks=tuple(missing))
        if state == "abort":
            raise SaveFailed(store.get_json(f"{base}/fail")["error"], step=step)
        frags = [fragment] + store.multi_get_json(keys)
        man = merge(frags, step, world, per_rank, user_metadata)
        kept = peer_protected(frags)
        if protect is not None:  # before the commit: the retention right after it must see them
            protect(kept)
        if not session.node_local:
            tier.commit(step, man, overwrite=overwrite)
        res = {"commit": True, "manifest": man.to_bytes().decode() if session.node_local else None}
        if session.node_local and kept:
            res["protect"] = sorted(kept)
    except BaseException as exc:
        res = {"commit": False, "error": str(exc)}
        try:
            store.set(f"{base}/result", json.dumps(res))
        except DistributedError as sexc:
            log.error("zerostall: could not publish the failure of step %d: %s", step, sexc)
        raise
    store.set(f"{base}/result", json.dumps(res))
    return res


def _commit_node_copy(store: Store, session: Session, base: str, res: dict[str, Any], tier: LocalTier, step: int,
                      overwrite: bool, deadline: float, timeout_s: float) -> None:
    """Node-local roots: each host's leader renames its own copy; the others wait for it."""
    key = f"{base}/done/{session.host}"
    if session.rank in session.leaders:
        try:
            tier.commit(step, Manifest.from_bytes(res["manifest"].encode()), overwrite=overwrite)
        except BaseException as exc:
            store.set(key, json.dumps({"ok": False, "error": str(exc)}))
            raise
        store.set(key, json.dumps({"ok": True}))
        return
    if store.poll([key], deadline) == "timeout":
        raise DistributedError(f"step {step}: the leader of host {session.host} did not commit its node-local copy "
                               f"within {timeout_s:g} s")
    done = store.get_json(key)
    if not done["ok"]:
        raise SaveFailed(f"step {step}: the node-local commit on {session.host} failed: {done['error']}", step=step)


class StoreCommitter:
    """Multi-rank commit strategy of the persist thread (module docstring); a
    :class:`~zerostall.store.committer.Committer`.

    ``begin``/``commit``/``fail`` run on the persist thread in job order; ``fail`` may also
    run on the caller's thread for a save that failed before it was queued (it then only
    reports and never blocks).
    """

    def __init__(self, tier: LocalTier, store: Store, session: Session, *, per_rank: bool, timeout_s: float):
        self.tier, self.store, self.session = tier, store, session
        self.rank, self.world = session.rank, session.world
        self.per_rank, self.timeout_s = per_rank, timeout_s
        self.node_local, self.leaders = session.node_local, session.leaders
        self.refs: RefTracker | None = None
        """Set by the Checkpointer for incremental saves (before the first save)."""
        self._reported: set[int] = set()  # steps whose outcome this rank sent (persist thread)

    def begin(self, job: SaveRequest) -> str:
        self._reported.discard(job.step)  # a new save of the step (overwrite)
        d = self.tier.partial_dir(job.step)
        os.makedirs(d, exist_ok=True)
        own = os.path.join(d, job.file_name)
        if os.path.lexists(own):  # left by an earlier, failed attempt of this rank
            os.unlink(own)
        return d

    def fragment(self, job: Persisted) -> dict[str, Any]:
        tree_json = json.dumps(job.plan.tree, sort_keys=True)
        shapes = json.dumps([[it.key, it.dtype, list(it.shape)] for it in job.plan.items], sort_keys=True)
        entries, ref_files = merged_entries(job, tensor_entries(job))  # written and referenced
        out = {"ok": True, "file": file_entry(job).__dict__, "n_tensors": job.plan.n_tensors,
               "tensors": [[g, e.to_json()] for g, e in entries], "tree": job.plan.tree,
               "structure": hashlib.sha256(tree_json.encode()).hexdigest() if not self.per_rank else shapes}
        if ref_files:
            out["ref_files"] = [r.to_json() for r in ref_files]
        if self.refs is not None:
            out["protect"] = sorted(self.refs.own_protected())
        return out

    def commit(self, job: Persisted) -> None:
        self._reported.add(job.step)
        commit_round(self.store, self.session, self.fragment(job), self.tier, job.step, per_rank=self.per_rank,
                     timeout_s=self.timeout_s, overwrite=job.overwrite, user_metadata=dict(job.user_metadata),
                     protect=self.refs.set_peer_protected if self.refs is not None else None)

    def after_durable(self, job: Persisted) -> tuple[str, ...]:
        return ()

    def report(self, step: int, exc: BaseException) -> None:
        """A save of ``step`` failed on this rank before a job was queued (caller's thread)."""
        report_failure(self.store, self.session, step, exc)

    def fail(self, job: SaveRequest, exc: BaseException, *, cleanup: bool = True) -> None:
        if job.step not in self._reported:  # its round ran: the others know; else tell them now
            report_failure(self.store, self.session, job.step, exc)
        if not cleanup:
            return
        if self.rank == 0 or self.node_local and self.rank in self.leaders:
            self.tier.abort(job.step)
        else:
            try:
                os.unlink(os.path.join(self.tier.partial_dir(job.step), job.file_name))
            except OSError:
                pass
