"""Frozen-base fine-tuning: incremental vs full zerostall saves vs torch.save vs DCP.

Moved into the CLI: this is ``zerostall bench --scenario frozen-base`` (see
``zerostall_bench.frozen`` and docs/incremental.md); the arguments are passed on.

Usage: python bench/scripts/frozen_base.py [--size-gib 0.5] [--repeat 5] [--json FILE] [--dir DIR]
"""

import sys

from zerostall.cli.app import main

if __name__ == "__main__":
    sys.exit(main(["bench", "--scenario", "frozen-base", *sys.argv[1:]]))
