"""Prometheus metrics for every save (optional: ``pip install 'zerostall[prometheus]'``; the
names, in base units, are in :func:`enable` and docs/configuration.md, each keyed by the
:class:`SaveRecord` field it reports). Created once per process (registries reject duplicates);
fed from the persist thread.
"""

from __future__ import annotations

import threading
from typing import Any

from .record import SaveRecord

_lock = threading.Lock()
_metrics: tuple[Any, dict[str, Any]] | None = None  # (saves by outcome, {SaveRecord field: update})


def enable() -> tuple[Any, dict[str, Any]]:
    """The metrics, created on the first call (ImportError with the install hint if unavailable)."""
    global _metrics
    with _lock:
        if _metrics is None:
            try:
                from prometheus_client import Counter, Gauge, Histogram
            except ImportError as exc:
                raise ImportError("Prometheus metrics need prometheus_client: "
                                  "pip install 'zerostall[prometheus]'") from exc
            buckets = (0.001, 0.005, 0.01, 0.05, 0.1, 0.5, 1, 5, 10, 60, 300)
            rate = Gauge("zerostall_persist_bytes_per_second", "Persist rate of the last save")
            _metrics = Counter("zerostall_saves_total", "Saves by outcome", ["outcome"]), {
                "stall_s": Histogram("zerostall_save_stall_seconds", "Time the training thread was blocked by a save",
                                     buckets=buckets).observe,
                "durable_s": Histogram("zerostall_save_durable_seconds", "save() to committed and fsynced",
                                       buckets=buckets).observe,
                "persist_gbps": lambda gbps: rate.set(gbps * 1e9),
                "bytes": Counter("zerostall_save_bytes_total", "Bytes committed").inc,
                "dirty_peak_bytes": Gauge("zerostall_host_dirty_bytes", "Host nr_dirty peak during the last save").set,
                "writeback_peak_bytes": Gauge("zerostall_host_writeback_bytes",
                                              "Host nr_writeback peak during the last save").set,
                "psi_io_full_peak": Gauge("zerostall_psi_io_full_percent", "PSI io full peak during the last save").set,
            }
        return _metrics


def observe(r: SaveRecord) -> None:
    saves, updates = enable()
    outcome = "skipped" if r.skipped else "ok" if r.ok else "failed"
    saves.labels(outcome=outcome).inc()
    if outcome == "ok":
        for field, update in updates.items():
            update(getattr(r, field))
