"""Soak: 200 SIGKILLs of a process saving in a loop; prints the tally.

Usage: python benchmarks/soak_crash.py [DIR] [--kills 200] [--seed 0]
Exit status 1 if any kill left a checkpoint that does not load bit-exact.
"""

import argparse
import shutil
import sys
import tempfile

from zerostall.bench.crashsoak import run

p = argparse.ArgumentParser()
p.add_argument("dir", nargs="?")
p.add_argument("--kills", type=int, default=200)
p.add_argument("--seed", type=int, default=0)
a = p.parse_args()
d = a.dir or tempfile.mkdtemp(prefix="zerostall-soak-")
try:
    t = run(d, a.kills, a.seed, progress=True)
finally:
    if a.dir is None:
        shutil.rmtree(d, ignore_errors=True)
print(f"kills: {t.kills}; newest checkpoint loaded bit-exact: {t.ok}; killed before the first commit: "
      f"{t.empty}; kills that left a .partial behind (ignored): {t.partial_seen}; failures: {len(t.failures)}")
for f in t.failures:
    print("  " + f)
sys.exit(1 if t.failures else 0)
