"""I/O engines: move aligned bytes between the staging arena and shard files.

Never writes through the page cache unless the ``buffered`` engine was chosen (by the probe
or the user); even then dirty memory is bounded. See :mod:`.base` for the call order.
"""

from .base import (Engine, Extent, ShardFile, choose_engine, engine_name_for, engine_names, get_engine,
                   register_engine)
from .probe import ProbeResult, probe

__all__ = ["Engine", "Extent", "ProbeResult", "ShardFile", "choose_engine", "engine_name_for", "engine_names",
           "get_engine", "probe", "register_engine"]
