import json

import pytest

from zerostall.telemetry.host import HostSample, Sampler, read_psi, read_vmstat
from zerostall.telemetry.trace import parse_trace_lines


def test_vmstat_real_and_recorded(tmp_path):
    real = read_vmstat()
    assert "nr_dirty" in real and "nr_writeback" in real
    rec = tmp_path / "vmstat"
    rec.write_text("nr_dirty 12\nnr_writeback 3\ngarbage line\nallocstall_normal 4\n")
    v = read_vmstat(str(rec))
    assert v == {"nr_dirty": 12, "nr_writeback": 3, "allocstall_normal": 4}
    assert read_vmstat(str(tmp_path / "missing")) == {}


def test_psi_real_and_recorded(tmp_path):
    real = read_psi("/proc/pressure/io")
    if real is not None:
        assert "some" in real and "avg10" in real["some"]
    rec = tmp_path / "io"
    rec.write_text("some avg10=1.50 avg60=0.20 avg300=0.00 total=1234\nfull avg10=0.75 avg60=0.10 avg300=0.00 total=99\n")
    p = read_psi(str(rec))
    assert p["full"]["avg10"] == 0.75 and p["some"]["total"] == 1234
    old = tmp_path / "old"  # kernels before 5.13 have no "full" line for cpu; missing lines are absent
    old.write_text("some avg10=0.00 avg60=0.00 avg300=0.00 total=0\n")
    assert "full" not in read_psi(str(old))
    assert read_psi(str(tmp_path / "nope")) is None


def test_sampler_peaks():
    s = Sampler(0.01)
    out = s.stop()
    assert set(out) >= {"dirty_peak_bytes", "dirty_rise_bytes", "writeback_peak_bytes", "psi_io_full_peak",
                        "psi_mem_full_peak", "kswapd_scan_delta", "rss_peak_bytes"}
    assert out["rss_peak_bytes"] > 0 and out["dirty_rise_bytes"] <= out["dirty_peak_bytes"]
    h = HostSample.now()
    assert h.rss_bytes > 0 and h.dirty_threshold_bytes > 0
    assert h.dirty_bg_threshold_bytes <= h.dirty_threshold_bytes  # the kernel keeps background <= foreground


def test_parse_tracepoint_lines():
    lines = [
        "  python3-4242  [001] d..1.  100.000: balance_dirty_pages: bdi 254:0: limit=1 setpoint=1 dirty=1 "
        "bdi_setpoint=1 bdi_dirty=1 dirty_ratelimit=1 task_ratelimit=1 dirtied=1 dirtied_pause=1 "
        "paused=0 pause=184 period=184 think=0 cgroup_ino=1",
        "          dd-77    [000] .....  101.0: balance_dirty_pages: bdi 254:0: pause=12 period=12",
        "# tracer: nop",
    ]
    assert parse_trace_lines(lines) == [(184, "python3", 4242), (12, "dd", 77)]


def test_prometheus_metrics_follow_the_record(tmp_path):
    """Each metric takes its SaveRecord field, in the unit its name says; only ok saves feed them."""
    prometheus_client = pytest.importorskip("prometheus_client")
    from zerostall.telemetry import prometheus
    from zerostall.telemetry.record import SaveRecord, emit

    get = prometheus_client.REGISTRY.get_sample_value
    prometheus.enable()
    before = {k: get(k) or 0.0 for k in ("zerostall_save_bytes_total", "zerostall_save_stall_seconds_count")}
    rec = SaveRecord(step=3, bytes=1000, stall_s=0.002, staged_s=0.1, durable_s=0.5, snapshot_s=0.1, persist_s=0.3,
                     commit_s=0.01, persist_gbps=1.5, engine="threads", arena_bytes=4096, dirty_peak_bytes=7 << 20,
                     writeback_peak_bytes=1 << 20, psi_io_full_peak=12.5)
    prometheus.observe(rec)
    prometheus.observe(SaveRecord(**{**rec.__dict__, "ok": False, "bytes": 99}))
    assert get("zerostall_save_bytes_total") == before["zerostall_save_bytes_total"] + 1000
    assert get("zerostall_save_stall_seconds_count") == before["zerostall_save_stall_seconds_count"] + 1
    assert get("zerostall_persist_bytes_per_second") == 1.5e9
    assert get("zerostall_host_dirty_bytes") == 7 << 20 and get("zerostall_psi_io_full_percent") == 12.5
    assert get("zerostall_saves_total", {"outcome": "failed"}) >= 1
    path = tmp_path / "records.jsonl"
    emit(rec, str(path))
    emit(rec, str(path))
    lines = path.read_text().splitlines()
    assert len(lines) == 2 and json.loads(lines[0])["step"] == 3
