"""``zerostall trace``: how long writers sleep in ``balance_dirty_pages``.

Three ways, best first: bpftrace with kprobes (:data:`BPFTRACE_PROGRAM`), the
``writeback:balance_dirty_pages`` tracepoint in a private tracefs instance (:func:`trace_tracefs`),
or sampling ``--pid``'s threads in D state (:func:`trace_pid`). Changes nothing but the trace
instance it creates and removes (and a tracefs mount).
"""

from __future__ import annotations

import contextlib
import math
import os
import re
import shutil
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

from .host import read_threads

BPFTRACE_PROGRAM = r"""#!/usr/bin/env bpftrace
kprobe:balance_dirty_pages { @start[tid] = nsecs; }
kretprobe:balance_dirty_pages /@start[tid]/ {
    $us = (nsecs - @start[tid]) / 1000;
    @stall_duration_us = hist($us);
    if ($us > 10000) { printf("%d %s blocked in dirty writeback for %u ms\n", pid, comm, $us / 1000); }
    delete(@start[tid]);
}
interval:s:5 { print(@stall_duration_us); clear(@stall_duration_us); }
"""

TRACEFS = "/sys/kernel/tracing"
_PAUSE_EDGES_MS = (0, 1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, math.inf)
_EVENT_RE = re.compile(r"^\s*(?P<comm>.+?)-(?P<pid>\d+)\s+.*?balance_dirty_pages:.*?\bpause=(?P<pause>-?\d+)")


@dataclass(frozen=True)
class TraceReport:
    method: str
    seconds: float
    pauses: list[tuple[int, str, int]]  # (pause ms, comm, pid) of each throttled write
    note: str = ""

    @property
    def worst(self) -> list[tuple[int, str, int]]:
        return sorted(self.pauses, reverse=True)[:10]

    def histogram(self) -> list[tuple[str, int]]:
        bins = [(lo, hi, sum(lo <= p < hi for p, _, _ in self.pauses))
                for lo, hi in zip(_PAUSE_EDGES_MS, _PAUSE_EDGES_MS[1:])]
        return [(f"[{lo}, {hi}) ms", n) for lo, hi, n in bins if n]

    def to_json(self) -> dict[str, object]:
        return {"method": self.method, "seconds": self.seconds, "events": len(self.pauses),
                "histogram": self.histogram(), "worst": self.worst, "note": self.note}


def kprobes_available() -> bool:
    return bool(shutil.which("bpftrace")) and (os.path.exists("/sys/kernel/debug/kprobes")
                                               or os.path.exists(f"{TRACEFS}/kprobe_events"))


def parse_trace_lines(lines: list[str]) -> list[tuple[int, str, int]]:
    """(pause ms, comm, pid) for each balance_dirty_pages event line."""
    return [(int(m["pause"]), m["comm"].strip(), int(m["pid"])) for m in map(_EVENT_RE.match, lines) if m]


def trace_tracefs(seconds: float) -> TraceReport:
    mounted_here = False
    if not os.path.isdir(os.path.join(TRACEFS, "events")):
        os.makedirs(TRACEFS, exist_ok=True)
        res = subprocess.run(["mount", "-t", "tracefs", "tracefs", TRACEFS], capture_output=True, text=True)
        if res.returncode != 0:
            raise PermissionError(f"cannot mount tracefs at {TRACEFS}: {res.stderr.strip()}")
        mounted_here = True
    inst = os.path.join(TRACEFS, "instances", f"zerostall-{os.getpid()}")
    try:
        os.mkdir(inst)
        ev = Path(inst, "events", "writeback", "balance_dirty_pages", "enable")
        if not ev.exists():
            raise FileNotFoundError("this kernel has no writeback:balance_dirty_pages tracepoint")
        ev.write_text("1")
        time.sleep(seconds)
        ev.write_text("0")
        lines = Path(inst, "trace").read_text().splitlines()
    finally:
        with contextlib.suppress(OSError):
            os.rmdir(inst)
        if mounted_here:
            subprocess.run(["umount", TRACEFS], capture_output=True)
    return TraceReport("tracepoint writeback:balance_dirty_pages", seconds, parse_trace_lines(lines))


def trace_pid(pid: int, seconds: float, interval_s: float = 0.01) -> TraceReport:
    """Sample ``pid``'s threads: contiguous D-state runs in balance_dirty_pages, in ms."""
    runs: dict[int, float] = {}
    pauses: list[tuple[int, str, int]] = []
    end = time.monotonic() + seconds
    comm = ""
    while time.monotonic() < end:
        now = time.monotonic()
        threads = read_threads(pid)
        if not threads and not os.path.exists(f"/proc/{pid}"):
            break
        for tid, comm, state, wchan in threads:
            if state == "D" and "balance_dirty" in wchan:
                runs.setdefault(tid, now)
            elif tid in runs:
                pauses.append((int((now - runs.pop(tid)) * 1000), comm, tid))
        time.sleep(interval_s)
    now = time.monotonic()
    pauses += [(int((now - t0) * 1000), comm, tid) for tid, t0 in runs.items()]
    return TraceReport(f"sampling /proc/{pid} (D state in balance_dirty_pages)", seconds, pauses,
                       note="sampled every 10 ms: pauses shorter than that are missed")
