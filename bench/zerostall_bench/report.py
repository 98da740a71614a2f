"""How ``zerostall bench`` shows its results: the one-line summary per method, the table and
the optional plot (caller's thread, after the runs)."""

from __future__ import annotations

import json
import os
import sys
from typing import Any


def write_doc(doc: dict[str, Any], path: str | None) -> None:
    """Write a bench results document (every scenario's ``--json``) atomically: a kill mid-write leaves
    the previous one."""
    if not path:
        return
    tmp = f"{path}.tmp"
    with open(tmp, "w") as f:
        json.dump(doc, f, indent=1)
    os.replace(tmp, path)


def _summary(row: dict[str, Any]) -> str:
    """One line per finished method, so a log cut short still says what each one measured."""
    return (f"lost {row['inproc_lost_s']:.3f} s same-proc / {row['lost_s']:.3f} s sep-proc, stall "
            f"{row['stall_s']:.3f} s, durable {row['durable_s']:.2f} s, {row['persist_gbps']:.2f} GB/s, restore "
            f"{row['restore_gbps']:.2f} GB/s, cold stall {_f(row.get('cold_stall_s'), '.3f')} s, "
            f"verified {row['verified']}")


def plot(series: dict[str, Any], path: str, doc: dict[str, Any]) -> None:
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("--plot needs matplotlib: pip install 'zerostall[plot]'", file=sys.stderr)
        return
    fig, (ax1, ax2) = plt.subplots(2, 1, figsize=(10, 7), sharex=True)
    for name, s in series.items():
        xs = [t for t, _ in s["steps"]]
        ax1.plot(xs, [d for _, d in s["steps"]], lw=0.8, label=name)
        ax2.plot([t for t, _ in s["dirty"]], [d / 2**20 for _, d in s["dirty"]], lw=1.2, label=name)
    ax1.set_yscale("log")
    ax1.set_ylabel("trainer step latency (ms)")
    ax2.set_ylabel("host nr_dirty (MiB)")
    ax2.set_xlabel("seconds since save() was called")
    thr = doc.get("throttle_write_mbps")
    ax1.set_title(f"{doc['size_bytes'] / 2**30:.1f} GiB checkpoint" + (f", writes throttled to {thr} MB/s" if thr else ""))
    ax1.axvline(0, color="k", lw=0.5)
    ax2.axvline(0, color="k", lw=0.5)
    ax1.legend(fontsize=8, ncol=3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def _f(v: Any, fmt: str) -> str:
    return "-" if v is None else format(v, fmt)


def print_table(doc: dict[str, Any], console: Any) -> None:
    from rich.table import Table
    lr = doc["line_rate"]
    t = Table(title=f"{doc['size_bytes'] / 2**30:.2f} GiB state, line rate {lr['write_gbps']:.2f} GB/s write / "
                    f"{lr['read_gbps']:.2f} GB/s read ({lr['tool']}), memcpy {doc['memcpy_gbps']:.1f} GB/s"
                    + (f", throttled to {doc['throttle_write_mbps']} MB/s" if doc["throttle_write_mbps"] else "")
                    + f", {doc.get('date', '')}")
    cols = ("method", "lost s (same proc)", "lost s (sep proc)", "stall s", "staged s", "durable s",
            "cold stall s", "cold durable s", "GB/s", "dirty peak MiB", "step p50/p99/max ms", ">2x",
            "restore GB/s", "x read", "ok")
    for c in cols:
        t.add_column(c, justify="left" if c == "method" else "right")
    for r in doc["results"]:
        if r.get("unavailable") or r.get("error"):
            t.add_row(r["method"], *["n/a" if r.get("unavailable") else "failed"] * (len(cols) - 1))
            continue
        t.add_row(r["method"], _f(r["inproc_lost_s"], ".3f"), _f(r["lost_s"], ".3f"), f"{r['stall_s']:.3f}",
                  f"{r['staged_s']:.2f}", f"{r['durable_s']:.2f}", _f(r.get("cold_stall_s"), ".3f"),
                  _f(r.get("cold_durable_s"), ".2f"), f"{r['persist_gbps']:.2f}",
                  f"{r['dirty_peak_bytes'] / 2**20:.0f}",
                  f"{r['step_p50_ms']:.0f}/{r['step_p99_ms']:.0f}/{r['step_max_ms']:.0f}", str(r["steps_over_2x_median"]),
                  f"{r['restore_gbps']:.2f}", _f(r.get("restore_fraction_of_read_line_rate"), ".2f"),
                  "yes" if r["verified"] else "NO")
    console.print(t)
    for r in doc["results"]:
        if r.get("unavailable") or r.get("error"):
            console.print(f"  {r['method']}: {r.get('unavailable') or 'failed: ' + r['error']}")
    news = [r for r in doc["results"] if "new_path_stall_s" in r]
    for r in news:
        console.print(f"  {r['method']}: a fresh Checkpointer on a new path blocked {r['new_path_stall_s'] * 1e3:.1f} ms "
                      f"(constructor + save(); save() alone {r['new_path_save_s'] * 1e3:.1f} ms)")
