"""Helpers the subcommands share (main thread): the engine and the tier a command reads."""

from __future__ import annotations

from typing import Any

from ..config import IOConfig
from ..io import choose_engine
from ..store import open_root


def _engine(name: str, root: str) -> Any:
    return choose_engine(root, IOConfig(engine=name))


def _tier(path: str) -> Any:
    """The tier a command reads: a local checkpoint directory, or a remote tier by URL
    (``s3://bucket/prefix``, ``file:///shared/path``)."""
    tier = open_root(path)
    tier.check_root()  # RootNotFound (exit 2): a typo is not an empty root
    return tier
