"""CLI subcommands about the host: ``doctor``, ``plan``, ``monitor``, ``trace``."""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Any
from ..tuning.doctor import host_checks, path_checks, probe_line_rate
from ..tuning.sysctl import apply_sysctls, sysctl_d_text
from ..tuning.plan import PlanInput, parse_count, plan
from ..telemetry.monitor import live, render, sample
from ..telemetry.trace import BPFTRACE_PROGRAM, kprobes_available, trace_pid, trace_tracefs

from .._term import console, safe, table


def cmd_doctor(a: argparse.Namespace) -> int:
    checks = host_checks() + path_checks(a.path)
    if a.probe:
        checks.append(probe_line_rate(a.path))
    if a.json:
        print(json.dumps([c.to_json() for c in checks], indent=1))
    else:
        from rich.text import Text
        t = table("zerostall doctor", ("check", "value", "status", "advice"), fold=True)
        colors = {"ok": "green", "warn": "yellow", "info": "blue"}
        for c in checks:
            t.add_row(safe(c.name), safe(c.value), Text(safe(c.status), style=colors.get(c.status, "white")),
                      safe(c.advice))
        console().print(t)
    if a.write_sysctl:
        with open(a.write_sysctl, "w") as f:
            f.write(sysctl_d_text())
        print(f"wrote {safe(a.write_sysctl)}; install it in /etc/sysctl.d/ and run 'sysctl --system'", file=sys.stderr)
    if a.apply:
        if os.geteuid() != 0:
            print("--apply needs root", file=sys.stderr)
            return 2
        before = apply_sysctls()
        print("applied; to revert:", file=sys.stderr)
        for k, v in before.items():
            if v is not None and not (v == 0 and (k.endswith("_ratio") or k.endswith("_bytes"))):
                print(f"  sysctl -w {k}={v}", file=sys.stderr)
    return 0


def cmd_plan(a: argparse.Namespace) -> int:
    def count(text: str | None, flag: str) -> float | None:
        return parse_count(text, flag) if text else None

    p = PlanInput(params=count(a.params, "--params"), bytes_per_param=a.bytes_per_param,
                  checkpoint_bytes=count(a.checkpoint_bytes, "--checkpoint-bytes"),
                  ranks=a.ranks, nodes=a.nodes, interval_min=a.interval_min, budget_s=a.budget_s,
                  fs_gbps=a.fs_gbps, nic_gbit=count(a.nic_gbps, "--nic-gbps"), node_ram_gib=a.node_ram_gib)
    r = plan(p)
    if a.json:
        print(json.dumps(r.to_json(), indent=1))
        return 0
    gb = 1e9
    print(f"checkpoint volume     {r.checkpoint_bytes / gb:,.1f} GB"
          + (f"  ({p.params / 1e9:g}B params x {p.bytes_per_param:g} bytes)" if p.params else ""))
    print(f"per rank / per node   {r.bytes_per_rank / gb:,.2f} GB / {r.bytes_per_node / gb:,.1f} GB")
    if r.nic_gbytes_per_s:
        print(f"node NICs             {r.nic_gbytes_per_s:,.1f} GB/s raw per node (~80% in practice)")
    if r.sync_stall_s is not None:
        print(f"synchronous stall     {r.sync_stall_s:,.0f} s per checkpoint at {r.effective_gbps:,.1f} GB/s")
    if r.lost_fraction is not None:
        print(f"time lost             {r.lost_fraction:.1%} of each {p.interval_min:g}-minute interval if synchronous")
    if r.required_gbps is not None:
        print(f"bandwidth for budget  {r.required_gbps:,.1f} GB/s to write it in {p.budget_s:g} s")
    if r.staging_fits_ram is not None:
        print(f"staging in node RAM   {'fits' if r.staging_fits_ram else 'DOES NOT FIT'} "
              f"({r.bytes_per_node / 2**30:,.0f} GiB vs 40% of {p.node_ram_gib:g} GiB)")
    print(f"bottleneck            {r.bottleneck}")
    return 0


def cmd_monitor(a: argparse.Namespace) -> int:
    if a.once:
        doc = sample(a.pid)
        if a.json:
            print(json.dumps(doc, indent=1))
        else:
            console().print(render(doc, None))
        return 0
    live(a.pid, a.interval_s)
    return 0


def cmd_trace(a: argparse.Namespace) -> int:
    if a.print_program:
        print(BPFTRACE_PROGRAM)
        return 0
    if kprobes_available() and not a.no_bpftrace:
        os.execvp("bpftrace", ["bpftrace", "-e", BPFTRACE_PROGRAM])
    try:
        rep = trace_tracefs(a.seconds)
    except (OSError, PermissionError) as exc:
        if a.pid is None:
            print(f"zerostall trace: tracefs unavailable ({exc}); give --pid to sample a process instead",
                  file=sys.stderr)
            return 2
        rep = trace_pid(a.pid, a.seconds)
    if a.json:
        print(json.dumps(rep.to_json(), indent=1))
        return 0
    print(f"{rep.method}: {rep.events} throttled writes in {rep.seconds:g} s")
    for label, n in rep.histogram():
        print(f"  {label:>18} {n:6d} {'#' * min(60, n)}")
    for pause, comm, pid in rep.worst[:5]:
        print(f"  worst: {safe(comm)} (pid {pid}) paused {pause} ms")
    if rep.note:
        print(f"  note: {safe(rep.note)}")
    return 0


def add_parsers(sub: Any) -> None:
    s = sub.add_parser("doctor", help="check this host and a checkpoint directory; advise sysctls")
    s.add_argument("path", nargs="?", default=".", help="checkpoint directory to check (not created; default .)")
    s.add_argument("--json", action="store_true", help="print the checks as JSON")
    s.add_argument("--probe", action="store_true", help="measure the direct-I/O line rate (512 MiB)")
    s.add_argument("--write-sysctl", metavar="FILE", help="write the recommendations as a sysctl.d file")
    s.add_argument("--apply", action="store_true", help="apply the recommendations now (root); prints how to revert")
    s.set_defaults(fn=cmd_doctor)

    s = sub.add_parser("plan", help="size checkpoints: volume, bandwidth, stall, RAM")
    s.add_argument("--params", help="parameter count, e.g. 70e9 or 175B")
    s.add_argument("--bytes-per-param", type=float, default=14.0,
                   help="checkpoint bytes per parameter (14: mixed precision + AdamW)")
    s.add_argument("--checkpoint-bytes", help="the checkpoint size directly, e.g. 2.4T")
    s.add_argument("--ranks", type=int, default=1, help="ranks writing in parallel")
    s.add_argument("--nodes", type=int, default=1, help="nodes (each with its own NIC)")
    s.add_argument("--interval-min", type=float, default=30.0, help="minutes between checkpoints")
    s.add_argument("--budget-s", type=float, help="time a checkpoint may take, seconds")
    s.add_argument("--fs-gbps", type=float, help="storage aggregate write rate, GB/s")
    s.add_argument("--nic-gbps", help="NIC bandwidth per node in Gbit/s, e.g. 200 or 2x100")
    s.add_argument("--node-ram-gib", type=float, help="RAM per node, GiB (does the staging arena fit?)")
    s.add_argument("--json", action="store_true", help="print the plan as JSON")
    s.set_defaults(fn=cmd_plan)

    s = sub.add_parser("monitor", help="nr_dirty, writeback, PSI, kswapd (and a process's state), live")
    s.add_argument("--pid", type=int, help="also show this process's state (D = blocked on I/O)")
    s.add_argument("--once", action="store_true", help="print one sample and exit")
    s.add_argument("--json", action="store_true", help="print samples as JSON lines")
    s.add_argument("--interval-s", type=float, default=0.5, help="seconds between samples")
    s.set_defaults(fn=cmd_monitor)

    s = sub.add_parser("trace", help="latency of writers throttled in balance_dirty_pages")
    s.add_argument("--seconds", type=float, default=10.0, help="how long to trace")
    s.add_argument("--pid", type=int, help="fallback: sample this process's threads")
    s.add_argument("--json", action="store_true", help="print the histogram as JSON")
    s.add_argument("--print-program", action="store_true", help="print the bpftrace program and exit")
    s.add_argument("--no-bpftrace", action="store_true", help="use the tracepoint or D-state sampling fallback")
    s.set_defaults(fn=cmd_trace)
