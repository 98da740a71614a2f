"""The subcommands beside :mod:`.app`'s (``delete``, ``doctor``, ``plan``, ``monitor``, ``trace``) and the
helpers every subcommand shares (main thread)."""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

from .._term import console, safe, table
from ..config import IOConfig
from ..errors import ConfigError, RootNotFound
from ..io import choose_engine
from ..peers.tombstones import delete_step
from ..store import open_root
from ..telemetry.host import HostSample, read_threads
from ..telemetry.trace import BPFTRACE_PROGRAM, kprobes_available, trace_pid, trace_tracefs
from ..tuning.doctor import apply_sysctls, host_checks, path_checks, probe_line_rate, sysctl_d_text
from ..tuning.plan import PlanInput, parse_count, plan


def _engine(name: str, root: str) -> Any:
    return choose_engine(root, IOConfig(engine=name))


def _tier(path: str) -> Any:
    """The tier a command reads: a local checkpoint directory, or a remote tier by URL
    (``s3://bucket/prefix``, ``file:///shared/path``)."""
    tier = open_root(path)
    tier.check_root()  # RootNotFound (exit 2): a typo is not an empty root
    return tier


def say(a: argparse.Namespace, line: str) -> None:
    """A progress line on stdout; with ``--json`` stdout holds only the document."""
    if not a.json:
        print(line, flush=True)


def verdict(a: argparse.Namespace, rows: list[dict[str, Any]]) -> int:
    """The end of ``verify``: the rows (one per step) as JSON with ``--json``; 1 if one failed."""
    if a.json:
        print(json.dumps(rows, indent=1))
    return 1 if any(r["state"] == "failed" for r in rows) else 0


def cmd_delete(a: argparse.Namespace) -> int:
    """``zerostall delete ROOT [ROOT ...] --step N``: delete steps for good, one root after the other,
    each under its root lock (a root a running job owns is refused), through
    :func:`zerostall.peers.tombstones.delete_step`. Run it on every node, each with its own root; a
    holder not reached now drops its copies when the job next starts, from the others' tombstones."""
    for root in a.roots:
        if not os.path.isdir(root):
            raise RootNotFound(f"no checkpoint directory {root!r}", root=root)
    for root in a.roots:
        for step in a.step:
            done = delete_step(root, step)
            for line in done or [f"step {step}: nothing of it in {root} (recorded as deleted)"]:
                print(safe(line))
    return 0


def cmd_doctor(a: argparse.Namespace) -> int:
    checks = host_checks() + path_checks(a.path)
    if a.probe:
        checks.append(probe_line_rate(a.path))
    if a.json:
        print(json.dumps([asdict(c) for c in checks], indent=1))
    else:
        from rich.text import Text
        t = table("zerostall doctor", ("check", "value", "status", "advice"), fold=True)
        colors = {"ok": "green", "warn": "yellow", "info": "blue"}
        for c in checks:
            t.add_row(safe(c.name), safe(c.value), Text(safe(c.status), style=colors.get(c.status, "white")),
                      safe(c.advice))
        console().print(t)
    if a.write_sysctl:
        Path(a.write_sysctl).write_text(sysctl_d_text())
        print(f"wrote {safe(a.write_sysctl)}; install it in /etc/sysctl.d/ and run 'sysctl --system'", file=sys.stderr)
    if a.apply:
        if os.geteuid() != 0:
            raise ConfigError("--apply needs root (or install the --write-sysctl file yourself)")
        before = apply_sysctls()
        print("applied; to revert:", file=sys.stderr)
        for k, v in before.items():
            if v is not None and not (v == 0 and k.endswith(("_ratio", "_bytes"))):
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
        print(json.dumps(asdict(r), indent=1))
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


# -- monitor: the host's writeback state as a document, once or as a live view (reads /proc only)
def process_state(pid: int) -> dict[str, Any]:
    """State letter, wchan (of its main thread) and D-state thread count of ``pid`` (None fields if it is gone)."""
    threads = read_threads(pid)
    _, comm, state, wchan = next((t for t in threads if t[0] == pid), (pid, None, None, None))
    return {"pid": pid, "state": state, "wchan": wchan or None,
            "threads_in_d": sum(1 for t in threads if t[2] == "D"), "comm": comm}


def sample(pid: int | None = None) -> dict[str, Any]:
    s = HostSample.now()
    doc: dict[str, Any] = {
        "time_unix": s.t, "dirty_bytes": s.dirty_bytes, "writeback_bytes": s.writeback_bytes,
        "dirty_threshold_bytes": s.dirty_threshold_bytes,
        "dirty_background_threshold_bytes": s.dirty_bg_threshold_bytes,
        "pgscan_kswapd": s.pgscan_kswapd, "pgscan_direct": s.pgscan_direct, "allocstall": s.allocstall,
        "psi_io_full_avg10": s.psi_io_full_avg10, "psi_mem_full_avg10": s.psi_mem_full_avg10,
    }
    if pid is not None:
        doc["process"] = process_state(pid)
    return doc


def _bar(v: float, limit: float, width: int = 30) -> str:
    frac = 0.0 if limit <= 0 else min(1.0, v / limit)
    n = int(frac * width)
    return "█" * n + "·" * (width - n)


def render(doc: dict[str, Any], prev: dict[str, Any] | None) -> Any:
    mib = 2**20
    t = table("zerostall monitor (Ctrl-C to quit)", ("metric", "value", ""), right=("value",))
    thr, bg = doc["dirty_threshold_bytes"], doc["dirty_background_threshold_bytes"]
    t.add_row("nr_dirty", f"{doc['dirty_bytes'] / mib:,.0f} MiB",
              f"{_bar(doc['dirty_bytes'], thr)} throttle at {thr / mib:,.0f} MiB")
    t.add_row("nr_writeback", f"{doc['writeback_bytes'] / mib:,.0f} MiB",
              f"background writeback from {bg / mib:,.0f} MiB")
    t.add_row("PSI io full avg10", f"{doc['psi_io_full_avg10']:.2f} %", "")
    t.add_row("PSI memory full avg10", f"{doc['psi_mem_full_avg10']:.2f} %", "")
    if prev is not None:
        dt = max(1e-6, doc["time_unix"] - prev["time_unix"])
        t.add_row("kswapd scans/s", f"{(doc['pgscan_kswapd'] - prev['pgscan_kswapd']) / dt:,.0f}", "")
        t.add_row("direct reclaim scans/s", f"{(doc['pgscan_direct'] - prev['pgscan_direct']) / dt:,.0f}", "")
    p = doc.get("process")
    if p:
        t.add_row(f"pid {p['pid']} ({safe(p['comm'])})", f"state {p['state']}",
                  f"wchan {safe(p['wchan'])}; {p['threads_in_d']} thread(s) in D")
    return t


def cmd_monitor(a: argparse.Namespace) -> int:
    doc = sample(a.pid)
    if a.once and a.json:
        print(json.dumps(doc, indent=1))
    elif a.once:
        console().print(render(doc, None))
    else:  # a live view, until Ctrl-C (exit 130)
        from rich.live import Live
        with Live(render(doc, None), console=console(), refresh_per_second=4) as view:
            while True:
                time.sleep(a.interval_s)
                prev, doc = doc, sample(a.pid)
                view.update(render(doc, prev))
    return 0


def cmd_trace(a: argparse.Namespace) -> int:
    if a.print_program:
        print(BPFTRACE_PROGRAM)
        return 0
    if kprobes_available() and not a.no_bpftrace:
        os.execvp("bpftrace", ["bpftrace", "-e", BPFTRACE_PROGRAM])
    try:
        rep = trace_tracefs(a.seconds)
    except OSError as exc:
        if a.pid is None:
            raise ConfigError(f"tracefs unavailable ({exc}); give --pid to sample a process instead") from exc
        rep = trace_pid(a.pid, a.seconds)
    if a.json:
        print(json.dumps(rep.to_json(), indent=1))
        return 0
    print(f"{rep.method}: {len(rep.pauses)} throttled writes in {rep.seconds:g} s")
    for label, n in rep.histogram():
        print(f"  {label:>18} {n:6d} {'#' * min(60, n)}")
    for pause, comm, pid in rep.worst[:5]:
        print(f"  worst: {safe(comm)} (pid {pid}) paused {pause} ms")
    if rep.note:
        print(f"  note: {safe(rep.note)}")
    return 0
