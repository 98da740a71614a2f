"""Render a `zerostall bench --json` document as the Markdown tables used in the README.

Usage: python benchmarks/render_table.py bench.json
"""

import json
import sys

doc = json.load(open(sys.argv[1]))
m, lr = doc["machine"], doc["line_rate"]
rows = doc["results"]
ran = [r for r in rows if not r.get("unavailable")]


def f(v, fmt):
    return "-" if v is None else format(v, fmt)


print(f"{doc['size_bytes'] / 2**30:.2f} GiB state (GPT-style fp32 weights + AdamW moments); "
      + (f"writes throttled to **{doc['throttle_write_mbps']} MB/s**; " if doc["throttle_write_mbps"] else "")
      + f"line rate {lr['write_gbps']:.2f} GB/s write / {lr['read_gbps']:.2f} GB/s read ({lr['tool']}); "
      f"warm memcpy {doc['memcpy_gbps']:.1f} GB/s; medians of {ran[0]['repeats']} runs; {doc.get('date', '')}.\n")
print("| method | **training time lost per checkpoint, s** (trainer in the same process) | lost s (trainer in a separate process) "
      "| stall s | cold: first save in a fresh process, blocked s | cold: durable s | durable s |")
print("|---|---:|---:|---:|---:|---:|---:|")
for r in rows:
    if r.get("unavailable"):
        print(f"| {r['method']} | {r['unavailable']} | | | | | |")
        continue
    print(f"| {r['method']} | **{r['inproc_lost_s']:.3f}** | {r['lost_s']:.3f} | {r['stall_s']:.3f} | "
          f"{f(r.get('cold_stall_s'), '.3f')} | {f(r.get('cold_durable_s'), '.2f')} | {r['durable_s']:.2f} |")
print()
print("| method | staged s | persist GB/s | of line rate | dirty peak MiB | trainer step p50 / p99 / max ms "
      "| steps > 2x median | in-process step max ms | restore GB/s | verified |")
print("|---|---:|---:|---:|---:|---:|---:|---:|---:|:---:|")
for r in ran:
    print(f"| {r['method']} | {r['staged_s']:.2f} | {r['persist_gbps']:.2f} | {r['fraction_of_line_rate']:.0%} | "
          f"{r['dirty_peak_bytes'] / 2**20:,.0f} | {r['step_p50_ms']:.0f} / {r['step_p99_ms']:.0f} / "
          f"{r['step_max_ms']:,.0f} | {r['steps_over_2x_median']} | {r['inproc_step_max_ms']:,.0f} | "
          f"{r['restore_gbps']:.2f} | {'yes' if r['verified'] else 'NO'} |")
news = [r for r in ran if "new_path_stall_s" in r]
if news:
    print()
    for r in news:
        print(f"- {r['method']}: a fresh Checkpointer on a new path (staging pool warm) blocked "
              f"{r['new_path_stall_s'] * 1e3:.1f} ms (constructor + `save()`; `save()` alone {r['new_path_save_s'] * 1e3:.1f} ms)")
print(f"\nMachine: {m['cpu']}, {m['cores']} cores, {m['ram_bytes'] / 2**30:.0f} GiB RAM, kernel {m['kernel']}, "
      f"{m['fs']} on {m['device']}, torch {m['torch']}.")
