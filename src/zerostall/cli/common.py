"""Helpers every subcommand uses (main thread): printing untrusted names, opening a tier."""

from __future__ import annotations

from typing import Any

from ..config import IOConfig
from ..io import choose_engine
from ..store import open_root


def safe(text: Any) -> str:
    """``text`` with control characters (ESC, BEL, bidi overrides, ...) shown as escapes."""
    out = []
    for ch in str(text):
        if ch.isprintable() or ch == " ":
            out.append(ch)
        else:
            out.append(repr(ch)[1:-1] if ord(ch) < 0x10000 else f"\\U{ord(ch):08x}")
    return "".join(out)


def _engine(name: str, root: str) -> Any:
    return choose_engine(root, IOConfig(engine=name))


def _tier(path: str) -> Any:
    """The tier a command reads: a local checkpoint directory, or a remote tier by URL
    (``s3://bucket/prefix``, ``file:///shared/path``)."""
    tier = open_root(path)
    tier.check_root()  # RootNotFound (exit 2): a typo is not an empty root
    return tier
