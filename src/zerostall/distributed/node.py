"""Where a process runs: its node and failure domain (environment names: docs/distributed.md),
its rank and world (:func:`discover`). Read per call, any thread; no state.
"""

from __future__ import annotations

import os
import re
import socket
import sys
from dataclasses import dataclass
from typing import Any

from ..errors import ConfigError

NODE_ENV = "ZEROSTALL_NODE"
DOMAIN_ENV = "ZEROSTALL_FAILURE_DOMAIN"
_NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._:-]{0,127}$")


def _named(env: str) -> str:
    """``$env`` (stripped), checked to be a valid name; "" when unset."""
    value = os.environ.get(env, "").strip()
    if value and not _NAME_RE.match(value):
        raise ConfigError(f"{env}={value!r} is not a valid name: use 1-128 letters, digits, '.', '_', ':' "
                          "or '-', starting with a letter or digit")
    return value


def node_id() -> str:
    """This process's node name: ``$ZEROSTALL_NODE``, else the host name."""
    return _named(NODE_ENV) or socket.gethostname()


def failure_domain() -> str:
    """This node's failure domain: ``$ZEROSTALL_FAILURE_DOMAIN``, else the node itself."""
    return _named(DOMAIN_ENV) or node_id()


@dataclass(frozen=True)
class RankInfo:
    rank: int
    world_size: int
    local_world_size: int
    store: Any = None


def discover(store: Any = None, mode: str = "per_rank") -> RankInfo:
    """From an initialised process group (any backend), else RANK/WORLD_SIZE/LOCAL_WORLD_SIZE;
    ``mode="local"``: a world of one (rank 0, no store), for a process that saves alone."""
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
