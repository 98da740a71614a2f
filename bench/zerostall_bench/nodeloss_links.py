"""``zerostall bench --scenario node-loss-links``: the node-loss benchmark on a cluster of network
namespaces with shaped links. The scenario lives beside the namespace-cluster harness in the
repository (``tests/cluster/nodeloss_links.py``, where its docstring says what it measures);
this entry maps the bench's options onto it. Needs root and a source checkout."""

from __future__ import annotations

import argparse
import importlib
import os
import sys

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def main(a: argparse.Namespace) -> int:
    if not os.path.isfile(os.path.join(REPO, "tests", "cluster", "nodeloss_links.py")):
        print("node-loss-links needs a zerostall source checkout (tests/cluster/nodeloss_links.py): run "
              "`python -m tests.cluster.nodeloss_links` from one", file=sys.stderr)
        return 2
    if REPO not in sys.path:
        sys.path.insert(0, REPO)
    argv = ["--mib", str(max(1, int(a.size_gib * 1024 / 4))), "--link-mbit", *map(str, a.link_mbit),
            "--s3-mbit", str(a.s3_mbit), "--rounds", str(a.repeat)]
    argv += (["--dir", a.dir] if a.dir else []) + (["--json", a.json] if a.json else [])
    return int(importlib.import_module("tests.cluster.nodeloss_links").main(argv) or 0)
