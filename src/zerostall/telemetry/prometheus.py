"""Prometheus metrics for every save (optional: ``pip install 'zerostall[prometheus]'``; the
names, in base units, are in :func:`_get` and docs/configuration.md). Created once per process
(registries reject duplicates); fed from the persist thread.
"""

from __future__ import annotations

import threading
from typing import Any

from .record import SaveRecord

_lock = threading.Lock()
_metrics: dict[str, Any] | None = None


def _get() -> dict[str, Any]:
    global _metrics
    with _lock:
        if _metrics is None:
            try:
                from prometheus_client import Counter, Gauge, Histogram
            except ImportError as exc:
                raise ImportError("Prometheus metrics need prometheus_client: "
                                  "pip install 'zerostall[prometheus]'") from exc
            buckets = (0.001, 0.005, 0.01, 0.05, 0.1, 0.5, 1, 5, 10, 60, 300)
            _metrics = {
                "stall": Histogram("zerostall_save_stall_seconds", "Time the training thread was blocked by a save",
                                   buckets=buckets),
                "durable": Histogram("zerostall_save_durable_seconds", "save() to committed and fsynced",
                                     buckets=buckets),
                "rate": Gauge("zerostall_persist_bytes_per_second", "Persist rate of the last save"),
                "bytes": Counter("zerostall_save_bytes_total", "Bytes committed"),
                "saves": Counter("zerostall_saves_total", "Saves by outcome", ["outcome"]),
                "dirty": Gauge("zerostall_host_dirty_bytes", "Host nr_dirty peak during the last save"),
                "writeback": Gauge("zerostall_host_writeback_bytes", "Host nr_writeback peak during the last save"),
                "psi": Gauge("zerostall_psi_io_full_percent", "PSI io full peak during the last save"),
            }
        return _metrics


def enable() -> None:
    """Create the metrics now (raises ImportError with the install hint if unavailable)."""
    _get()


def observe(r: SaveRecord) -> None:
    m = _get()
    outcome = "skipped" if r.skipped else "ok" if r.ok else "failed"
    m["saves"].labels(outcome=outcome).inc()
    if outcome != "ok":
        return
    m["stall"].observe(r.stall_s)
    m["durable"].observe(r.durable_s)
    m["rate"].set(r.persist_gbps * 1e9)
    m["bytes"].inc(r.bytes)
    m["dirty"].set(r.dirty_peak_bytes)
    m["writeback"].set(r.writeback_peak_bytes)
    m["psi"].set(r.psi_io_full_peak)
