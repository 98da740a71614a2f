"""Soak: 200 SIGKILLs of a process saving in a loop; prints the tally.

Usage: python bench/scripts/soak_crash.py [DIR] [--kills 200] [--seed 0] [--incremental]
Exit status 1 if any kill left a checkpoint that does not load bit-exact.
"""

import argparse
import os
import shutil
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
from tests.fault.crashsoak import run  # noqa: E402  (the fault suite's harness, run longer)

p = argparse.ArgumentParser()
p.add_argument("dir", nargs="?")
p.add_argument("--kills", type=int, default=200)
p.add_argument("--seed", type=int, default=0)
p.add_argument("--incremental", action="store_true", help="Checkpointer(incremental=True) with a frozen part")
a = p.parse_args()
d = a.dir or tempfile.mkdtemp(prefix="zerostall-soak-")
try:
    t = run(d, a.kills, a.seed, progress=True, incremental=a.incremental)
finally:
    if a.dir is None:
        shutil.rmtree(d, ignore_errors=True)
print(f"kills: {t.kills}; newest checkpoint loaded bit-exact: {t.ok}; killed before the first commit: "
      f"{t.empty}; kills that left a .partial behind (ignored): {t.partial_seen}; newest step referenced an "
      f"earlier one's file: {t.referencing}; failures: {len(t.failures)}")
for f in t.failures:
    print("  " + f)
sys.exit(1 if t.failures else 0)
