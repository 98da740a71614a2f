"""Tiers: where committed checkpoints live (local root, remote tiers by URL scheme: :mod:`.tier`)."""

from __future__ import annotations

import os
from typing import Any

from .local import LocalTier
from .tier import Tier, is_url, open_tier

__all__ = ["LocalTier", "open_root"]


def open_root(where: Any, **kwargs: Any) -> Tier:
    """The tier of a checkpoint root: a :class:`LocalTier` for a plain path (``kwargs`` such as
    ``create=True``), or the tier registered for a URL's scheme (:func:`open_tier`)."""
    if isinstance(where, Tier):
        return where
    if is_url(where):
        return open_tier(str(where), **kwargs)
    return LocalTier(os.fspath(where), **kwargs)
