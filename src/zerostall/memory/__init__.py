"""Host memory for staging and restore: the arena, the pool of faulted blocks, the ring, the
budget (the share of host RAM a node's ranks may pin). Imports ``io`` and ``format`` at most."""

from .arena import Arena
from .ring import BlockRing

__all__ = ["Arena", "BlockRing"]
