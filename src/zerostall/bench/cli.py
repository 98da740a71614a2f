"""Argument parsers for the CLI subcommands that live above the library (demo, bench)."""

from __future__ import annotations

import argparse
import importlib
from typing import Any


def _lazy(module: str, fn: str) -> Any:
    def run(a: argparse.Namespace) -> int:
        return getattr(importlib.import_module(module), fn)(a)
    return run


def add_parsers(sub: Any) -> None:
    s = sub.add_parser("demo", help="train a small transformer with async checkpoints, crash it, resume bit-exact")
    s.add_argument("--steps", type=int, default=60)
    s.add_argument("--every", type=int, default=10, help="checkpoint interval in steps")
    s.add_argument("--dir", default=None, help="checkpoint directory (default: a temp dir, removed)")
    s.add_argument("--keep", action="store_true", help="keep the checkpoint directory")
    s.add_argument("--seed", type=int, default=0)
    s.add_argument("--tiny", action="store_true", help="a tiny model (used by the tests)")
    s.set_defaults(fn=_lazy("zerostall.bench.demo", "main"))
