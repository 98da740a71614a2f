"""The cross-rank commit, through the c10d store (never the training's process group).

Why the store and not a gloo group: the commit runs on each rank's persist thread, at a
different moment on every rank. Store operations are independent key/value requests with
per-call timeouts, safe from any thread; a collective on a group would have to be entered
by every rank in the same order, and one rank that failed, skipped or died would leave the
others blocked inside it. The store (torchrun's rendezvous store, or the one passed in) is
already there, and its traffic is a few small keys per rank per checkpoint.

Protocol for save number ``seq`` (every rank saves in the same order), keys under
``<prefix>/<seq>-<step>/``:

1. every rank writes its shard into ``step-N.partial/rank-R.shard`` and fdatasyncs it;
2. every rank sets ``r<R>`` = its fragment (file entry, tensor entries with crc32c, tree) or
   ``{"ok": false, "error": ...}``;
3. rank 0 (the coordinator) waits for all ``r*`` keys (``commit_timeout_s``); if every rank
   is durable it merges the fragments into one manifest and runs the local tier's commit
   (manifest, fsync, rename, fsync, latest) — on a node-local root every node's lowest rank
   does steps 3's rename on its own disk after the decision;
4. rank 0 sets ``result`` = ``{"commit": true}`` or ``{"commit": false, "error": ...}``;
   the others wait for it (same timeout) and finish their handles accordingly.

A rank that dies before step 2 never reports: rank 0 times out, publishes the failure and
removes the partial directory; nobody commits. If rank 0 dies, the others time out waiting
for ``result`` and fail their handles; nothing was renamed, so nothing is committed.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import socket
import time
import uuid
from datetime import timedelta
from typing import Any

from ..errors import RootLockedError, SaveFailed, ZerostallError
from ..format.manifest import FileEntry, Manifest, TensorEntry
from ..format.tree import remap_tree
from ..staging.job import SaveJob
from ..store.local import LocalTier
from ..store.persist import file_entry, tensor_entries

log = logging.getLogger("zerostall")


def _wait(store: Any, keys: list[str], timeout_s: float) -> None:
    store.wait(keys, timedelta(seconds=timeout_s))


def _missing(store: Any, keys: list[str]) -> list[str]:
    return [k for k in keys if not store.check([k])]


def setup_protocol(store: Any, prefix: str, rank: int, world: int, tier: LocalTier,
                   timeout_s: float) -> dict[str, Any]:
    """Start-up round (all ranks, caller's thread): agree whether the root is shared, and clean
    stale partials once per filesystem. Returns ``{"node_local": bool, "leaders": [...]}``."""
    host = socket.gethostname()
    if rank == 0:
        token = uuid.uuid4().hex
        with open(os.path.join(tier.root, f".zerostall-shared-{token}"), "w"):
            pass
        store.set(f"{prefix}/token", token)
    _wait(store, [f"{prefix}/token"], timeout_s)
    token = store.get(f"{prefix}/token").decode()
    sees = os.path.exists(os.path.join(tier.root, f".zerostall-shared-{token}"))
    store.set(f"{prefix}/init/r{rank}", json.dumps({"host": host, "sees": sees}))
    if rank == 0:
        keys = [f"{prefix}/init/r{r}" for r in range(world)]
        _wait(store, keys, timeout_s)
        infos = [json.loads(store.get(k)) for k in keys]
        node_local = not all(i["sees"] for i in infos)
        leaders: dict[str, int] = {}
        for r, i in enumerate(infos):
            leaders.setdefault(i["host"], r)
        os.unlink(os.path.join(tier.root, f".zerostall-shared-{token}"))
        store.set(f"{prefix}/ready", json.dumps({"node_local": node_local, "leaders": sorted(leaders.values())}))
    _wait(store, [f"{prefix}/ready"], timeout_s)
    cfg = json.loads(store.get(f"{prefix}/ready"))
    own_error: ZerostallError | None = None
    if rank in cfg["leaders"] if cfg["node_local"] else rank == 0:
        try:  # the one writer of this root: lock it (RootLockedError names the holder), recover it
            tier.own()
        except ZerostallError as exc:
            own_error = exc
    store.set(f"{prefix}/cleaned/r{rank}", json.dumps({"error": str(own_error)} if own_error else {}))
    keys = [f"{prefix}/cleaned/r{r}" for r in range(world)]
    _wait(store, keys, timeout_s)
    failed = [(r, e) for r, k in enumerate(keys) if (e := json.loads(store.get(k) or b"{}").get("error"))]
    if failed:  # every rank fails at once, rather than after a commit timeout
        tier.release()
        if own_error is not None:
            raise own_error
        r, msg = failed[0]
        raise RootLockedError(f"rank {r} could not take the checkpoint root: {msg}", root=tier.root)
    return cfg


def merge(fragments: list[dict[str, Any]], step: int, world: int, per_rank: bool,
          user_metadata: dict[str, Any]) -> Manifest:
    """One manifest from every rank's fragment (rank order)."""
    files = tuple(FileEntry(**f["file"]) for f in fragments)
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
                    user_metadata=user_metadata, rank_trees=rank_trees)


def commit_round(store: Any, base: str, rank: int, world: int, fragment: dict[str, Any], tier: LocalTier,
                 step: int, *, per_rank: bool, timeout_s: float, overwrite: bool = False,
                 node_local: bool = False, leaders: list[int] | None = None,
                 user_metadata: dict[str, Any] | None = None) -> None:
    """Steps 2-4 of the protocol for one rank. Raises :class:`SaveFailed` if nothing committed."""
    store.set(f"{base}/r{rank}", json.dumps(fragment))
    if rank == 0:
        keys = [f"{base}/r{r}" for r in range(world)]
        try:
            try:
                _wait(store, keys, timeout_s)
            except Exception:  # noqa: BLE001 - DistStoreError / RuntimeError by torch version
                missing = [k.rsplit("/r", 1)[1] for k in _missing(store, keys)]
                raise SaveFailed(f"step {step}: rank(s) {', '.join(missing)} did not report within "
                                 f"{timeout_s:g} s (died or stuck); nothing committed", step=step) from None
            frags = [json.loads(store.get(k)) for k in keys]
            bad = [(r, f.get("error", "?")) for r, f in enumerate(frags) if not f.get("ok")]
            if bad:
                raise SaveFailed(f"step {step}: rank {bad[0][0]} failed: {bad[0][1]}; nothing committed", step=step)
            man = merge(frags, step, world, per_rank, user_metadata or {})
            if not node_local:
                tier.commit(step, man, overwrite=overwrite)
            store.set(f"{base}/result", json.dumps({"commit": True, "manifest": man.to_bytes().decode()
                                                    if node_local else None}))
        except BaseException as exc:
            store.set(f"{base}/result", json.dumps({"commit": False, "error": str(exc)}))
            raise
        for k in keys:
            store.delete_key(k)
    else:
        try:
            _wait(store, [f"{base}/result"], timeout_s)
        except Exception:  # noqa: BLE001
            raise SaveFailed(f"step {step}: the coordinator (rank 0) published no result within {timeout_s:g} s; "
                             "nothing committed", step=step) from None
    res = json.loads(store.get(f"{base}/result"))
    if not res["commit"]:
        raise SaveFailed(res["error"], step=step)
    if node_local:
        host_key = f"{base}/done/{socket.gethostname()}"
        if rank in (leaders or []):
            man = Manifest.from_bytes(res["manifest"].encode())
            tier.commit(step, man, overwrite=overwrite)
            store.set(host_key, "1")
        else:
            _wait(store, [host_key], timeout_s)


class StoreCommitter:
    """Multi-rank commit strategy for the persist thread (see the module docstring)."""

    def __init__(self, tier: LocalTier, store: Any, prefix: str, rank: int, world: int, *,
                 per_rank: bool, timeout_s: float, node_local: bool, leaders: list[int]):
        self.tier, self.store, self.prefix = tier, store, prefix
        self.rank, self.world = rank, world
        self.per_rank, self.timeout_s = per_rank, timeout_s
        self.node_local, self.leaders = node_local, leaders
        self._reported: set[int] = set()

    def _base(self, job: SaveJob) -> str:
        return f"{self.prefix}/{job.seq}-{job.step}"

    def begin(self, job: SaveJob) -> str:
        d = self.tier.partial_dir(job.step)
        os.makedirs(d, exist_ok=True)
        own = os.path.join(d, job.file_name)
        if os.path.lexists(own):  # left by an earlier, failed attempt of this rank
            os.unlink(own)
        return d

    def fragment(self, job: SaveJob) -> dict[str, Any]:
        tree_json = json.dumps(job.plan.tree, sort_keys=True)
        shapes = json.dumps([[it.key, it.dtype, list(it.shape)] for it in job.plan.items], sort_keys=True)
        return {"ok": True, "file": file_entry(job).__dict__, "n_tensors": job.plan.n_tensors,
                "tensors": [[g, e.to_json()] for g, e in tensor_entries(job)], "tree": job.plan.tree,
                "structure": hashlib.sha256(tree_json.encode()).hexdigest() if not self.per_rank else shapes}

    def commit(self, job: SaveJob) -> None:
        self._reported.add(job.seq)
        commit_round(self.store, self._base(job), self.rank, self.world, self.fragment(job), self.tier, job.step,
                     per_rank=self.per_rank, timeout_s=self.timeout_s, overwrite=job.overwrite,
                     node_local=self.node_local, leaders=self.leaders, user_metadata=job.user_metadata)

    def fail(self, job: SaveJob, exc: BaseException) -> None:
        base = self._base(job)
        if job.seq not in self._reported:  # tell the coordinator, so nobody waits for the timeout
            self._reported.add(job.seq)
            try:
                self.store.set(f"{base}/r{self.rank}", json.dumps({"ok": False, "error": str(exc)}))
                if self.rank == 0:
                    self.store.set(f"{base}/result", json.dumps({"commit": False, "error": str(exc)}))
            except Exception as sexc:  # noqa: BLE001 - the store may be gone with rank 0
                log.error("zerostall: could not report the failure of step %d: %s", job.step, sexc)
        if self.rank == 0 or self.node_local and self.rank in self.leaders:
            self.tier.abort(job.step)
        else:
            try:
                os.unlink(os.path.join(self.tier.partial_dir(job.step), job.file_name))
            except OSError:
                pass
