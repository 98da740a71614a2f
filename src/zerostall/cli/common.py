"""What the subcommands share (main thread): the tier a command reads."""

from __future__ import annotations

from typing import Any

from ..store import open_root


def _tier(path: str) -> Any:
    """The tier a command reads: a local checkpoint directory, or a remote tier by URL
    (``s3://bucket/prefix``, ``file:///shared/path``)."""
    tier = open_root(path)
    tier.check_root()  # RootNotFound (exit 2): a typo is not an empty root
    return tier
