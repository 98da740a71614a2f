"""Build the save plan: what goes where in the shard file, before any byte is copied.

Called from the caller's thread inside ``save()``; pure metadata work (no tensor data is
read), so its cost is proportional to the number of tensors, not their size.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from ..format.dtypes import dtype_name
from ..format.layout import HEADER_BYTES, align_up
from ..format.tree import TensorLeaf, encode_tree


@dataclass(frozen=True)
class PlanItem:
    index: int
    key: str
    dtype: str
    shape: tuple[int, ...]
    nbytes: int
    offset: int


@dataclass(frozen=True)
class SavePlan:
    """The frozen layout of one rank's shard file."""

    items: tuple[PlanItem, ...]
    file_bytes: int
    tree: Any
    leaves: tuple[TensorLeaf, ...]
    n_tensors: int = 0
    """Tensors in the whole state (all ranks' shares when replicated)."""

    @property
    def payload_bytes(self) -> int:
        return sum(i.nbytes for i in self.items)

    @property
    def devices(self) -> set[str]:
        return {leaf.tensor.device.type for leaf in self.leaves}


def owners_by_size(leaves: tuple[TensorLeaf, ...] | list[TensorLeaf], world_size: int) -> list[int]:
    """A deterministic owner rank per tensor, balancing bytes (largest first, least loaded)."""
    load = [0] * world_size
    owner = [0] * len(leaves)
    sizes = [leaf.tensor.numel() * leaf.tensor.element_size() for leaf in leaves]
    for i in sorted(range(len(leaves)), key=lambda i: (-sizes[i], i)):
        r = min(range(world_size), key=lambda r: (load[r], r))
        owner[i] = r
        load[r] += sizes[i]
    return owner


def build_plan(state_dict: Any, *, rank: int = 0, world_size: int = 1, replicated: bool = False) -> SavePlan:
    """Flatten ``state_dict`` and assign every tensor an aligned offset after the header.

    With ``replicated`` (every rank holds the same state), this rank's plan holds only the
    tensors it owns (:func:`owners_by_size`); ``PlanItem.index`` stays the global index.
    """
    tree, all_leaves = encode_tree(state_dict)
    owner = owners_by_size(all_leaves, world_size) if replicated and world_size > 1 else None
    items = []
    leaves = []
    off = HEADER_BYTES
    for i, leaf in enumerate(all_leaves):
        if owner is not None and owner[i] != rank:
            continue
        leaves.append(leaf)
        t: torch.Tensor = leaf.tensor
        nbytes = t.numel() * t.element_size()
        items.append(PlanItem(i, leaf.key, dtype_name(t.dtype, leaf.key), tuple(t.shape), nbytes, off))
        off = align_up(off + nbytes)
    return SavePlan(tuple(items), max(off, HEADER_BYTES), tree, tuple(leaves), len(all_leaves))

