"""Summarise bench/scripts/revision_ab.sh's output directory: per revision, the median over
rounds of each figure, and new/old.

Usage: python bench/scripts/revision_ab_summary.py OUT_DIR
"""

import glob
import json
import os
import statistics
import sys


def figures(path: str) -> dict[str, float]:
    doc = json.load(open(path))
    name = os.path.basename(path).split("-")[0]
    out: dict[str, float] = {}
    if name == "save":
        rows = {r["method"]: r for r in doc["results"] if not r.get("unavailable")}
        zs = rows.get("zerostall-uring")
        if zs:
            for base in ("torch.save", "dcp"):
                if base in rows:
                    out[f"save: stall / {base}"] = zs["stall_s"] / rows[base]["stall_s"]
                    out[f"save: durable / {base}"] = zs["durable_s"] / rows[base]["durable_s"]
            out["save: durable fraction of write line rate"] = zs["fraction_of_line_rate"]
    elif name == "restore":
        for r in doc["results"]:
            if r["method"].startswith("zerostall") and "fraction_of_read_line_rate" in r:
                out[f"restore {r['method']}: fraction of read line rate"] = r["fraction_of_read_line_rate"]
    elif name == "many":
        for k, v in doc["ratios"].items():
            out[f"100k tensors: {k}"] = v
    return out


def main(out_dir: str) -> None:
    by: dict[tuple[str, str], list[float]] = {}
    for path in sorted(glob.glob(os.path.join(out_dir, "*.json"))):
        rev = os.path.basename(path).split("-")[1]
        try:
            for k, v in figures(path).items():
                by.setdefault((k, rev), []).append(v)
        except (KeyError, ValueError, ZeroDivisionError) as exc:
            print(f"skipped {path}: {exc!r}", file=sys.stderr)
    keys = sorted({k for k, _ in by})
    print("| figure | old | new | new / old |\n|---|---:|---:|---:|")
    for k in keys:
        old, new = by.get((k, "old")), by.get((k, "new"))
        o = statistics.median(old) if old else None
        n = statistics.median(new) if new else None
        ratio = f"{n / o:.2f}" if o and n else "-"
        print(f"| {k} | {'-' if o is None else f'{o:.3f}'} | {'-' if n is None else f'{n:.3f}'} | {ratio} |")


if __name__ == "__main__":
    main(sys.argv[1])
