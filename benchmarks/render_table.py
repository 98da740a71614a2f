"""Render a `zerostall bench --json` document as the Markdown table used in the README."""

import json
import sys

doc = json.load(open(sys.argv[1]))
m, lr = doc["machine"], doc["line_rate"]
print(f"{doc['size_bytes'] / 2**30:.2f} GiB state (GPT-style fp32 weights + AdamW moments); "
      + (f"writes throttled to **{doc['throttle_write_mbps']} MB/s**; " if doc["throttle_write_mbps"] else "")
      + f"line rate {lr['write_gbps']:.2f} GB/s write / {lr['read_gbps']:.2f} GB/s read ({lr['tool']}); "
      f"warm memcpy {doc['memcpy_gbps']:.1f} GB/s; medians of {doc['results'][0]['repeats']} runs.\n")
print("| method | stall s | staged s | durable s | persist GB/s | of line rate | dirty peak MiB | "
      "trainer step p50 / p99 / max ms | steps > 2x median | restore GB/s | verified |")
print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|:---:|")
for r in doc["results"]:
    print(f"| {r['method']} | {r['stall_s']:.3f} | {r['staged_s']:.2f} | {r['durable_s']:.2f} | "
          f"{r['persist_gbps']:.2f} | {r['fraction_of_line_rate']:.0%} | {r['dirty_peak_bytes'] / 2**20:,.0f} | "
          f"{r['step_p50_ms']:.0f} / {r['step_p99_ms']:.0f} / {r['step_max_ms']:,.0f} | {r['steps_over_2x_median']} | "
          f"{r['restore_gbps']:.2f} | {'yes' if r['verified'] else 'NO'} |")
print(f"\nMachine: {m['cpu']}, {m['cores']} cores, {m['ram_bytes'] / 2**30:.0f} GiB RAM, kernel {m['kernel']}, "
      f"{m['fs']} on {m['device']}, torch {m['torch']}.")
