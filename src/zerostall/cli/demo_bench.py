"""``zerostall demo`` (the library's zerostall/demo/) and ``zerostall bench`` (the separate
zerostall_bench package, found at parser build time and imported only then; where it is not
installed the command says how to install it). Called by cli/app.py's build_parser."""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import sys
from typing import Any

BENCH_HINT = ("the benchmark lives in the zerostall-bench package, which is not installed here: "
              "from a zerostall checkout, pip install -e ./bench (make test and make bench install it)")


def _positive(kind: Any) -> Any:
    def parse(text: str) -> Any:
        try:
            v = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
        if not v > 0:
            raise argparse.ArgumentTypeError(f"{text!r} must be > 0")
        return v
    return parse


def _demo(a: argparse.Namespace) -> int:
    return int(importlib.import_module("zerostall.demo.run").main(a))


def bench_installed() -> bool:
    """Whether the zerostall_bench package can be imported (a seam for the test of the hint)."""
    return importlib.util.find_spec("zerostall_bench") is not None


def _bench_missing(a: argparse.Namespace) -> int:
    print(f"zerostall bench: {BENCH_HINT}", file=sys.stderr)
    return 1


def add_parsers(sub: Any) -> None:
    s = sub.add_parser("demo", help="train a small transformer with async checkpoints, crash it, resume bit-exact")
    s.add_argument("--steps", type=_positive(int), default=60, help="training steps")
    s.add_argument("--every", type=_positive(int), default=10, help="checkpoint interval in steps")
    s.add_argument("--dir", default=None, help="checkpoint directory (default: a temp dir, removed)")
    s.add_argument("--keep", action="store_true", help="keep the checkpoint directory")
    s.add_argument("--seed", type=int, default=0, help="random seed of the model and data")
    s.add_argument("--tiny", action="store_true", help="a tiny model (used by the tests)")
    s.set_defaults(fn=_demo)

    help_ = "zerostall vs torch.save vs DCP on the same disk, with a training loop running"
    if bench_installed():
        from zerostall_bench import cli as bench_cli  # argparse only: no torch at parser build time
        s = sub.add_parser("bench", help=help_)
        bench_cli.add_arguments(s)
        s.set_defaults(fn=bench_cli.run)
    else:
        # every word after "bench", options and --help included, is taken as an argument: any
        # invocation prints the hint (prefix_chars no argument starts with)
        s = sub.add_parser("bench", help=f"{help_} (needs zerostall-bench)", add_help=False, prefix_chars="\0")
        s.add_argument("args", nargs="*")
        s.set_defaults(fn=_bench_missing)
