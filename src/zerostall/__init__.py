"""zerostall: checkpoints for PyTorch training that the training loop does not feel.

Public surface (see README): :class:`Checkpointer`, :func:`save`, :func:`load`, the configs,
the handle and record types, :mod:`zerostall.errors`, :func:`register_type` (objects allowed
to be rebuilt on load), :func:`rng_state`/:func:`set_rng_state`. Framework adapters live in
:mod:`zerostall.integrations` (imported on demand).

Each public name is bound on first use (PEP 562 ``__getattr__``, from the module
:data:`_SOURCES` names), so that ``import zerostall`` and the CLI's commands that never touch
a tensor (``--help``, ``plan``, ``ls``, ``inspect``, ``doctor``) do not import torch;
``dir(zerostall)`` and ``__all__`` list every name all the same.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from . import errors

if TYPE_CHECKING:
    from .checkpointer import Checkpointer
    from .config import CheckpointConfig, IOConfig, PeersConfig, StagingConfig
    from .format.objects import register_type
    from .oneshot import load, save
    from .restore import LoadReport
    from .rng import rng_state, set_rng_state
    from .saving.handle import SaveHandle
    from .telemetry.record import SaveRecord

__version__ = "0.1.0"

_SOURCES = {
    "CheckpointConfig": ".config", "Checkpointer": ".checkpointer", "IOConfig": ".config",
    "LoadReport": ".restore", "PeersConfig": ".config", "SaveHandle": ".saving.handle",
    "SaveRecord": ".telemetry.record", "StagingConfig": ".config", "load": ".oneshot",
    "register_type": ".format.objects", "rng_state": ".rng", "save": ".oneshot", "set_rng_state": ".rng",
}
"""Where each public name lives (every name of ``__all__`` but the module ``errors``)."""
__all__ = sorted([*_SOURCES, "errors"])


def __getattr__(name: str) -> Any:
    source = _SOURCES.get(name)
    if source is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(source, __name__), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
