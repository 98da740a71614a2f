"""Merging the ranks' fragments of one step into the manifest(s) the coordinator commits.

Rank 0's persist thread, once per round (:mod:`.commit`); pure functions, no I/O.
"""

from __future__ import annotations

import time
from typing import Any

from ..errors import SaveFailed
from ..format.manifest import FileEntry, Manifest, TensorEntry
from ..format.refs import RefFile
from ..format.decode import remap_tree


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
        _same_structure(fragments, step)
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


def manifests(fragments: list[dict[str, Any]], groups: list[tuple[int, ...]], names: tuple[str, ...], step: int,
              world: int, per_rank: bool, user_metadata: dict[str, Any]) -> dict[str, bytes]:
    """The manifest each copy commits, by group name (``names``, in ``groups`` order): per_rank,
    one for all; replicated with several copies, each its members' fragments (docs/distributed.md)."""
    by_rank = {f["file"]["rank"]: f for f in fragments}
    if per_rank or len(groups) == 1:
        one = merge([by_rank[r] for r in range(world)], step, world, per_rank, user_metadata).to_bytes()
        return {n: one for n in names}
    _same_structure([by_rank[r] for r in range(world)], step)  # every copy holds the same state
    return {n: merge([by_rank[r] for r in g], step, world, False, user_metadata).to_bytes()
            for n, g in zip(names, groups)}


def _same_structure(fragments: list[dict[str, Any]], step: int) -> None:
    """Replicated mode: every fragment's state has the first one's keys, dtypes and shapes."""
    for f in fragments:
        if f["structure"] != fragments[0]["structure"]:
            r, r0 = f["file"]["rank"], fragments[0]["file"]["rank"]
            raise SaveFailed(f"step {step}: rank {r}'s state differs from rank {r0}'s in its keys, dtypes or "
                             "shapes; replicated mode needs identical state dicts on every rank (use "
                             "dist_mode='per_rank')", step=step)


def peer_protected(fragments: list[dict[str, Any]]) -> set[int]:
    """Steps any rank's incremental base or save in flight may reference (``RefTracker.protected``
    at the time the rank reported): the retention of the rank(s) that delete must keep them."""
    return {int(s) for f in fragments for s in f.get("protect", ())}
