"""Cost of the non-tensor part of a state: a Hugging Face-style log history in a save.

Usage: python bench/scripts/manifest_encoding.py [--entries 100000] [--repeat 5]

Measures, for a state holding a list of N small dicts (``{"loss", "step", "epoch",
"learning_rate", "grad_norm"}``) next to a small model:

- ``json.dumps`` of the same list (the yardstick);
- ``build_plan`` (what ``save()`` runs on the caller's thread: snapshot, size estimate);
- ``build_plan`` + ``Manifest.to_bytes`` (the whole encoding work of a save, the objects'
  encoding included, which a save runs off the caller's thread);
- ``Manifest.from_bytes`` + ``decode_tree`` (the load side).

Prints the best of ``--repeat`` runs for each and the ratios to ``json.dumps``; the issue's
target is a save overhead within 2x of ``json.dumps``.
"""

from __future__ import annotations

import argparse
import json
import time

import torch

from zerostall.format.manifest import FileEntry, Manifest, TensorEntry
from zerostall.format.tree import decode_tree
from zerostall.saving.plan import build_plan


def _best(fn, repeat: int) -> float:
    best = float("inf")
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--entries", type=int, default=100_000, help="log history entries (small dicts)")
    ap.add_argument("--repeat", type=int, default=5, help="runs per measurement; the best is reported")
    a = ap.parse_args()
    hist = [{"loss": 2.5 / (i + 1), "step": i, "epoch": i / 1000, "learning_rate": 3e-4 * (1 - i / a.entries),
             "grad_norm": 0.25 + i % 7} for i in range(a.entries)]
    state = {"model": {"w": torch.zeros(16, 16), "b": torch.zeros(16)}, "log_history": hist, "step": a.entries}

    def manifest(plan):
        tree, tree_json = plan.final()  # the frozen Python objects encoded (background in a save)
        return Manifest(step=1, world_size=1, checkpoint_id="x" * 32, created_unix=time.time(),
                        files=(FileEntry("rank-00000.shard", 0, "host", plan.file_bytes),),
                        tensors=tuple(TensorEntry(i.key, i.dtype, i.shape, "rank-00000.shard", i.offset, i.nbytes, 0)
                                      for i in plan.items),
                        tree=tree, tree_json=tree_json)

    t_dumps = _best(lambda: json.dumps(hist), a.repeat)
    t_plan = _best(lambda: build_plan(state), a.repeat)
    t_save = _best(lambda: manifest(build_plan(state)).to_bytes(), a.repeat)
    raw = manifest(build_plan(state)).to_bytes()
    t_load = _best(lambda: decode_tree(Manifest.from_bytes(raw).tree, [None, None]), a.repeat)
    print(f"{a.entries} log entries; manifest {len(raw) / 2**20:.1f} MiB (json.dumps of the list: "
          f"{len(json.dumps(hist)) / 2**20:.1f} MiB)")
    for name, t in (("json.dumps(list)", t_dumps), ("save(): build_plan, caller's thread", t_plan),
                    ("build_plan + Manifest.to_bytes", t_save), ("Manifest.from_bytes + decode", t_load)):
        print(f"  {name:38s} {t * 1e3:8.1f} ms   {t / t_dumps:5.2f}x json.dumps")


if __name__ == "__main__":
    main()
