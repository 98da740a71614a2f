"""Build the save plan: what goes where in the shard file, before any byte is copied.

Called from the caller's thread inside ``save()``; pure metadata work (no tensor data is
read), so its cost is proportional to the number of tensors, not their size.
"""

from __future__ import annotations

import math
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

    @property
    def payload_bytes(self) -> int:
        return sum(i.nbytes for i in self.items)

    @property
    def devices(self) -> set[str]:
        return {leaf.tensor.device.type for leaf in self.leaves}


def build_plan(state_dict: Any) -> SavePlan:
    """Flatten ``state_dict`` and assign every tensor an aligned offset after the header."""
    tree, leaves = encode_tree(state_dict)
    items = []
    off = HEADER_BYTES
    for i, leaf in enumerate(leaves):
        t: torch.Tensor = leaf.tensor
        nbytes = t.numel() * t.element_size()
        items.append(PlanItem(i, leaf.key, dtype_name(t.dtype, leaf.key), tuple(t.shape), nbytes, off))
        off = align_up(off + nbytes)
    return SavePlan(tuple(items), max(off, HEADER_BYTES), tree, tuple(leaves))


def shape_numel(shape: tuple[int, ...]) -> int:
    return math.prod(shape)
