"""``SaveRecord``: the typed outcome of one save (built on the persist thread when a save
finishes), and its sinks (log line, JSON lines).
"""

from __future__ import annotations

import json
import logging
from dataclasses import asdict, dataclass

log = logging.getLogger("zerostall")


@dataclass(frozen=True)
class SaveRecord:
    """All times in seconds, sizes in bytes, rates in GB/s (1e9 bytes/s)."""

    step: int
    bytes: int
    stall_s: float
    staged_s: float
    durable_s: float
    snapshot_s: float
    persist_s: float
    commit_s: float
    persist_gbps: float
    engine: str
    arena_bytes: int
    skipped: bool = False
    ok: bool = True
    error: str = ""
    post_commit_errors: tuple[str, ...] = ()
    """Failures after the commit point (the ``latest`` hint, retention); the step is committed."""
    dirty_peak_bytes: int = 0
    dirty_rise_bytes: int = 0
    writeback_peak_bytes: int = 0
    psi_io_full_peak: float = 0.0
    psi_mem_full_peak: float = 0.0
    kswapd_scan_delta: int = 0
    rss_peak_bytes: int = 0
    bytes_written: int = 0
    """Shard bytes this save wrote (== ``bytes``)."""
    bytes_referenced: int = 0
    """Tensor bytes an incremental save referenced in earlier steps' files instead of writing."""
    post_commit_s: float = 0.0
    """The persist thread's time on this save after it was durable (``latest`` hint, retention,
    replication hand-off): ``persist_s + commit_s + post_commit_s`` is its time per save."""
    interval_steps: int = 0
    """Steps since this Checkpointer's previous save that was not skipped (0 for its first)."""
    replica_nodes: tuple[str, ...] = ()
    """This rank's node and the nodes holding copies of its files once the step is protected; else empty."""

    def log_line(self) -> str:
        if self.skipped:
            return f"step {self.step}: skipped (earlier saves still hold the staging arena)"
        if not self.ok:
            return f"step {self.step}: FAILED: {self.error}"
        warn = f"; after the commit: {'; '.join(self.post_commit_errors)}" if self.post_commit_errors else ""
        return (f"step {self.step}: {self.bytes / 1e9:.2f} GB, stall {self.stall_s * 1e3:.1f} ms, "
                f"staged {self.staged_s:.2f} s, durable {self.durable_s:.2f} s, persist "
                f"{self.persist_gbps:.2f} GB/s ({self.engine}), dirty +{self.dirty_rise_bytes >> 20} MiB{warn}")


def emit(record: SaveRecord, jsonl_path: str | None, dirty_threshold_bytes: int = 0) -> None:
    """Send ``record`` to the ``zerostall`` logger and, if configured, a JSON-lines file."""
    log.info("zerostall: %s", record.log_line())
    if dirty_threshold_bytes and record.dirty_peak_bytes > 0.8 * dirty_threshold_bytes:
        log.warning("zerostall: step %d: host dirty memory peaked at %d MiB, near the throttle "
                    "threshold (%d MiB): writers elsewhere on this host may stall",
                    record.step, record.dirty_peak_bytes >> 20, dirty_threshold_bytes >> 20)
    if record.kswapd_scan_delta > 0:
        log.warning("zerostall: step %d: kswapd scanned %d pages during the save (memory pressure)",
                    record.step, record.kswapd_scan_delta)
    if jsonl_path:  # unbuffered: one O_APPEND write per line, whole lines from every thread and process
        with open(jsonl_path, "ab", buffering=0) as f:
            f.write(json.dumps(asdict(record), sort_keys=True).encode() + b"\n")
