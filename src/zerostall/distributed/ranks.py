"""Rank, world size, local world size and the c10d store, from torch.distributed or torchrun's env."""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class RankInfo:
    rank: int
    world_size: int
    local_world_size: int
    store: Any = None


def discover(store: Any = None, mode: str = "per_rank") -> RankInfo:
    """From an initialised process group (any backend), else RANK/WORLD_SIZE/LOCAL_WORLD_SIZE.

    ``mode="local"``: a world of one (rank 0, no store), whatever the process group says —
    for a process that saves alone (rank-0-only frameworks, tools).
    """
    local = int(os.environ.get("LOCAL_WORLD_SIZE", "1") or 1)
    if mode == "local":
        return RankInfo(0, 1, local, None)
    dist = sys.modules.get("torch.distributed")  # a process group exists only once this was imported
    if dist is not None and dist.is_available() and dist.is_initialized():
        rank, world = dist.get_rank(), dist.get_world_size()
        if store is None and world > 1:
            from torch.distributed import distributed_c10d as c10d
            store = c10d._get_default_store()
        return RankInfo(rank, world, local, store)
    return RankInfo(int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1")), local, store)
