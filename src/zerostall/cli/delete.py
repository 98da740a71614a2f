"""``zerostall delete ROOT [ROOT ...] --step N``: delete steps for good, one root after the other,
each under its root lock (a root a running job owns is refused), through
:func:`zerostall.peers.tombstones.delete_step`. Run it on every node, each with its own root; a
holder not reached now drops its copies when the job next starts, from the others' tombstones.
"""

from __future__ import annotations

import argparse
import os

from .._term import safe
from ..errors import RootNotFound
from ..peers.tombstones import delete_step


def add_parser(sub: "argparse._SubParsersAction[argparse.ArgumentParser]") -> None:
    s = sub.add_parser("delete", help="delete steps for good: from each root given and from the copies it holds for "
                                      "peers (a tombstone keeps them from coming back from other holders)")
    s.add_argument("roots", nargs="+", metavar="ROOT", help="a local checkpoint directory (one per node)")
    s.add_argument("--step", type=_step, action="append", required=True, help="the step to delete (repeat for more)")
    s.set_defaults(fn=cmd_delete)


def _step(text: str) -> int:
    try:
        step = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a step number (an integer >= 0)") from None
    if step < 0:
        raise argparse.ArgumentTypeError(f"{step} is not a step number (steps are integers >= 0)")
    return step


def cmd_delete(a: argparse.Namespace) -> int:
    for root in a.roots:
        if not os.path.isdir(root):
            raise RootNotFound(f"no checkpoint directory {root!r}", root=root)
    for root in a.roots:
        for step in a.step:
            done = delete_step(root, step)
            for line in done or [f"step {step}: nothing of it in {root} (recorded as deleted)"]:
                print(safe(line))
    return 0
