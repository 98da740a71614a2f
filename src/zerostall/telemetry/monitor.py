"""``zerostall monitor``: one sample of the host's writeback state, or a live view of it
(CLI thread; reads /proc only).
"""

from __future__ import annotations

import time
from typing import Any

from .._term import console, safe, table
from .host import HostSample, read_threads


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


def live(pid: int | None, interval_s: float) -> None:
    from rich.live import Live
    prev = None
    with Live(render(sample(pid), None), console=console(), refresh_per_second=4) as view:
        while True:
            time.sleep(interval_s)
            doc = sample(pid)
            view.update(render(doc, prev))
            prev = doc
