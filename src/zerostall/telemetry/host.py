"""Parsers for /proc/vmstat, /proc/pressure/* and the process's RSS, and a 10 Hz sampler.

Parsers accept kernels that lack fields (missing keys read as 0, a missing PSI file as
None). The sampler runs in its own daemon thread for the duration of one save and keeps
peaks and deltas; it is started and stopped by the ``Checkpointer`` (caller's thread and
persist thread respectively).
"""

from __future__ import annotations

import os
import threading
import time
from dataclasses import dataclass

PAGE = os.sysconf("SC_PAGE_SIZE")


def read_vmstat(path: str = "/proc/vmstat") -> dict[str, int]:
    out: dict[str, int] = {}
    try:
        with open(path) as f:
            for line in f:
                k, _, v = line.partition(" ")
                try:
                    out[k] = int(v)
                except ValueError:
                    continue
    except OSError:
        pass
    return out


def read_psi(path: str) -> dict[str, dict[str, float]] | None:
    """``{"some": {"avg10": .., "total": ..}, "full": {...}}`` or None where PSI is absent."""
    try:
        with open(path) as f:
            text = f.read()
    except OSError:
        return None
    out: dict[str, dict[str, float]] = {}
    for line in text.splitlines():
        parts = line.split()
        if not parts:
            continue
        vals = {}
        for p in parts[1:]:
            k, _, v = p.partition("=")
            try:
                vals[k] = float(v)
            except ValueError:
                pass
        out[parts[0]] = vals
    return out


def read_rss_bytes(pid: int | str = "self") -> int:
    try:
        with open(f"/proc/{pid}/statm") as f:
            return int(f.read().split()[1]) * PAGE
    except (OSError, ValueError, IndexError):
        return 0


@dataclass(frozen=True)
class HostSample:
    t: float
    dirty_bytes: int
    writeback_bytes: int
    dirty_threshold_bytes: int
    dirty_bg_threshold_bytes: int
    pgscan_kswapd: int
    pgscan_direct: int
    allocstall: int
    psi_io_full_avg10: float
    psi_mem_full_avg10: float
    psi_io_full_total_us: float
    psi_mem_full_total_us: float
    rss_bytes: int

    @classmethod
    def now(cls) -> "HostSample":
        v = read_vmstat()
        io = read_psi("/proc/pressure/io") or {}
        mem = read_psi("/proc/pressure/memory") or {}
        return cls(
            t=time.time(),
            dirty_bytes=v.get("nr_dirty", 0) * PAGE,
            writeback_bytes=v.get("nr_writeback", 0) * PAGE,
            dirty_threshold_bytes=v.get("nr_dirty_threshold", 0) * PAGE,
            dirty_bg_threshold_bytes=v.get("nr_dirty_background_threshold", 0) * PAGE,
            pgscan_kswapd=v.get("pgscan_kswapd", 0),
            pgscan_direct=v.get("pgscan_direct", 0),
            allocstall=sum(val for k, val in v.items() if k.startswith("allocstall")),
            psi_io_full_avg10=io.get("full", {}).get("avg10", 0.0),
            psi_mem_full_avg10=mem.get("full", {}).get("avg10", 0.0),
            psi_io_full_total_us=io.get("full", {}).get("total", 0.0),
            psi_mem_full_total_us=mem.get("full", {}).get("total", 0.0),
            rss_bytes=read_rss_bytes(),
        )


class Sampler:
    """Samples the host every ``interval_s`` until ``stop()``; keeps peaks and deltas."""

    def __init__(self, interval_s: float = 0.1, keep_series: bool = False):
        self.interval_s = interval_s
        self.keep_series = keep_series
        self.series: list[HostSample] = []
        self.first = HostSample.now()
        self.last = self.first
        self.peak_dirty = self.first.dirty_bytes
        self.peak_writeback = self.first.writeback_bytes
        self.peak_psi_io = 0.0  # percent of wall time with all tasks stalled, per interval
        self.peak_psi_mem = 0.0
        self.peak_rss = self.first.rss_bytes
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="zerostall-sampler", daemon=True)
        self._thread.start()

    def _take(self) -> None:
        s = HostSample.now()
        prev, self.last = self.last, s
        dt_us = (s.t - prev.t) * 1e6
        if dt_us > 0:  # PSI "full" as % of wall time over this interval (avg10 lags a short save)
            self.peak_psi_io = max(self.peak_psi_io, 100 * (s.psi_io_full_total_us - prev.psi_io_full_total_us) / dt_us)
            self.peak_psi_mem = max(self.peak_psi_mem,
                                    100 * (s.psi_mem_full_total_us - prev.psi_mem_full_total_us) / dt_us)
        self.peak_dirty = max(self.peak_dirty, s.dirty_bytes)
        self.peak_writeback = max(self.peak_writeback, s.writeback_bytes)
        self.peak_rss = max(self.peak_rss, s.rss_bytes)
        if self.keep_series:
            self.series.append(s)

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            self._take()

    def stop(self) -> dict[str, float | int]:
        self._stop.set()
        self._thread.join()
        self._take()
        return {
            "dirty_peak_bytes": self.peak_dirty,
            "dirty_rise_bytes": max(0, self.peak_dirty - self.first.dirty_bytes),
            "writeback_peak_bytes": self.peak_writeback,
            "psi_io_full_peak": self.peak_psi_io,
            "psi_mem_full_peak": self.peak_psi_mem,
            "kswapd_scan_delta": self.last.pgscan_kswapd - self.first.pgscan_kswapd,
            "rss_peak_bytes": self.peak_rss,
            "dirty_threshold_bytes": self.last.dirty_threshold_bytes,
        }
