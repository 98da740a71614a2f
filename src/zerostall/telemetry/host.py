"""Parsers for /proc/vmstat, /proc/pressure/*, a process's RSS and threads, and a 10 Hz sampler.

Missing fields read as 0, a missing PSI file as None. A :class:`Sampler` keeps one save's
peaks and deltas: created on the caller's thread in ``save()``, stopped by the persist thread,
served by the process's one sampling thread (:class:`_Hub`).
"""

from __future__ import annotations

import contextlib
import os
import queue
import threading
import time
from dataclasses import dataclass
from pathlib import Path

PAGE = os.sysconf("SC_PAGE_SIZE")


def read_vmstat(path: str = "/proc/vmstat") -> dict[str, int]:
    out: dict[str, int] = {}
    try:
        with open(path) as f:
            for line in f:
                k, _, v = line.partition(" ")
                with contextlib.suppress(ValueError):
                    out[k] = int(v)
    except OSError:
        pass
    return out


def read_psi(path: str) -> dict[str, dict[str, float]] | None:
    """``{"some": {"avg10": .., "total": ..}, "full": {...}}`` or None where PSI is absent."""
    try:
        with open(path) as f:
            rows = [line.split() for line in f if line.strip()]
    except OSError:
        return None
    out: dict[str, dict[str, float]] = {}
    for kind, *fields in rows:
        out[kind] = {k: float(v) for k, _, v in (field.partition("=") for field in fields)}
    return out


def read_threads(pid: int) -> list[tuple[int, str, str, str]]:
    """(tid, comm, state letter, wchan) of each thread of ``pid`` still there ([] if it is gone)."""
    out = []
    try:
        tids = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return out
    for tid in tids:
        try:
            stat = Path(f"/proc/{pid}/task/{tid}/stat").read_text()
            wchan = Path(f"/proc/{pid}/task/{tid}/wchan").read_text().strip()
        except OSError:
            continue
        out.append((int(tid), stat[stat.find("(") + 1:stat.rfind(")")], stat[stat.rfind(")") + 2], wchan))
    return out


def read_rss_bytes(pid: int | str = "self") -> int:
    try:
        return int(Path(f"/proc/{pid}/statm").read_text().split()[1]) * PAGE
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
        io, mem = ((read_psi(f"/proc/pressure/{r}") or {}).get("full", {}) for r in ("io", "memory"))
        return cls(
            t=time.time(),
            dirty_bytes=v.get("nr_dirty", 0) * PAGE,
            writeback_bytes=v.get("nr_writeback", 0) * PAGE,
            dirty_threshold_bytes=v.get("nr_dirty_threshold", 0) * PAGE,
            dirty_bg_threshold_bytes=v.get("nr_dirty_background_threshold", 0) * PAGE,
            pgscan_kswapd=v.get("pgscan_kswapd", 0),
            pgscan_direct=v.get("pgscan_direct", 0),
            allocstall=sum(val for k, val in v.items() if k.startswith("allocstall")),
            psi_io_full_avg10=io.get("avg10", 0.0),
            psi_mem_full_avg10=mem.get("avg10", 0.0),
            psi_io_full_total_us=io.get("total", 0.0),
            psi_mem_full_total_us=mem.get("total", 0.0),
            rss_bytes=read_rss_bytes(),
        )


class _Hub:
    """The process's one sampling thread: samples for every due sampler, sleeps until the next.

    Registration is a reentrant ``SimpleQueue.put``: a signal handler that waits for the persist
    thread may interrupt it (see the Checkpointer's signal-safety note).
    """

    def __init__(self) -> None:
        self.q: queue.SimpleQueue["Sampler"] = queue.SimpleQueue()
        self.thread: threading.Thread | None = None
        self._start_lock = threading.Lock()  # taken only by registering threads, never by the hub

    def add(self, s: "Sampler") -> None:
        self.q.put(s)
        self.start()

    def start(self) -> None:
        if self.thread is None:
            with self._start_lock:
                if self.thread is None:  # once per process
                    self.thread = threading.Thread(target=self._run, name="zerostall-sampler", daemon=True)
                    self.thread.start()

    def _run(self) -> None:
        active: list[Sampler] = []
        while True:
            timeout = max(0.0, min(s._due for s in active) - time.monotonic()) if active else None
            with contextlib.suppress(queue.Empty):
                active.append(self.q.get(timeout=timeout))
                while True:  # take every sampler that arrived meanwhile
                    active.append(self.q.get_nowait())
            active = [s for s in active if not s._stopped]
            now = time.monotonic()
            due = [s for s in active if s._due <= now]
            if due:
                sample = HostSample.now()
                for s in due:
                    s._offer(sample)


_hub = _Hub()


def start_sampling_thread() -> None:
    """Start the process's sampling thread now (the Checkpointer does, before the staging
    pool starts faulting: a thread's start maps its stack, which waits on the mmap lock)."""
    _hub.start()


def _after_fork_in_child() -> None:
    global _hub
    _hub = _Hub()  # the parent's thread does not exist in the child


os.register_at_fork(after_in_child=_after_fork_in_child)


class Sampler:
    """Samples the host every ``interval_s`` until ``stop()``; keeps peaks and deltas.
    Construction only registers with the sampling thread (cheap, any thread)."""

    def __init__(self, interval_s: float = 0.1, keep_series: bool = False):
        self.interval_s = interval_s
        self.keep_series = keep_series
        self.series: list[HostSample] = []
        self.first: HostSample | None = None
        self.last: HostSample | None = None
        self.peak_dirty = 0
        self.peak_writeback = 0
        self.peak_psi_io = 0.0  # percent of wall time with all tasks stalled, per interval
        self.peak_psi_mem = 0.0
        self.peak_rss = 0
        self._lock = threading.Lock()  # the hub thread and stop() may both offer a sample
        self._stopped = False
        self._due = 0.0
        _hub.add(self)

    def _offer(self, s: HostSample) -> None:
        with self._lock:
            if self._stopped and self.last is not None:
                return
            self._due = time.monotonic() + self.interval_s
            self._take(s)

    def _take(self, s: HostSample) -> None:
        prev, self.last = self.last, s
        if self.first is None:
            self.first = s
        if self.keep_series:
            self.series.append(s)
        dt_us = (s.t - prev.t) * 1e6 if prev is not None else 0.0
        if dt_us > 0:  # PSI "full" as % of wall time over this interval (avg10 lags a short save)
            self.peak_psi_io = max(self.peak_psi_io, 100 * (s.psi_io_full_total_us - prev.psi_io_full_total_us) / dt_us)
            self.peak_psi_mem = max(self.peak_psi_mem,
                                    100 * (s.psi_mem_full_total_us - prev.psi_mem_full_total_us) / dt_us)
        self.peak_dirty = max(self.peak_dirty, s.dirty_bytes)
        self.peak_writeback = max(self.peak_writeback, s.writeback_bytes)
        self.peak_rss = max(self.peak_rss, s.rss_bytes)

    def stop(self) -> dict[str, float | int]:
        final = HostSample.now()
        with self._lock:
            self._stopped = True
            self._take(final)
            first, last = self.first, self.last
        assert first is not None and last is not None
        return {
            "dirty_peak_bytes": self.peak_dirty,
            "dirty_rise_bytes": max(0, self.peak_dirty - first.dirty_bytes),
            "writeback_peak_bytes": self.peak_writeback,
            "psi_io_full_peak": self.peak_psi_io,
            "psi_mem_full_peak": self.peak_psi_mem,
            "kswapd_scan_delta": last.pgscan_kswapd - first.pgscan_kswapd,
            "rss_peak_bytes": self.peak_rss,
            "dirty_threshold_bytes": last.dirty_threshold_bytes,
        }
