"""doctor, plan, monitor and trace as a user runs them."""

import json
import os
import subprocess
import sys

import pytest

from zerostall.cli import main as cli
from zerostall.tuning.doctor import RECOMMENDED, read_sysctls


def restore_sysctls(values):
    """Write back values from ``read_sysctls`` (ratios after bytes where the ratio was set)."""
    for n, v in values.items():
        if v is None or (v == 0 and (n.endswith("_bytes") or n.endswith("_ratio"))):
            continue
        with open(os.path.join("/proc/sys", *n.split(".")), "w") as f:
            f.write(str(v))


def test_doctor_json_reports_every_field(tmp_path, capsys):
    before = read_sysctls()
    assert cli(["doctor", str(tmp_path), "--json"]) == 0
    checks = {c["name"]: c for c in json.loads(capsys.readouterr().out)}
    expected = {"ram_bytes", "dirty_threshold_bytes", "dirty_background_threshold_bytes", "rlimit_memlock_bytes",
                "transparent_hugepages", "io_uring", "staging_budget_bytes", "path", "filesystem", "o_direct",
                "statx_dioalign", "engine"} | set(RECOMMENDED)
    assert expected <= set(checks)
    for c in checks.values():
        assert c["status"] in ("ok", "warn", "info")
        if c["status"] == "warn":
            assert c["advice"]
    assert checks["ram_bytes"]["value"] > 0
    assert read_sysctls() == before  # nothing changed


def test_doctor_write_sysctl_is_valid(tmp_path):
    out = tmp_path / "99-zerostall.conf"
    assert cli(["doctor", str(tmp_path), "--json", "--write-sysctl", str(out)]) == 0
    seen = {}
    for line in out.read_text().splitlines():
        if not line.strip() or line.startswith("#"):
            continue
        k, eq, v = line.partition(" = ")
        assert eq and k.startswith("vm.") and v.isdigit(), line
        seen[k] = int(v)
    assert seen == {k: v for k, (v, _) in RECOMMENDED.items()}


def test_plan_cli_json(capsys):
    assert cli(["plan", "--params", "70B", "--fs-gbps", "5", "--interval-min", "30", "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert {"checkpoint_bytes", "bytes_per_rank", "bytes_per_node", "sync_stall_s", "lost_fraction",
            "required_gbps", "staging_fits_ram", "bottleneck"} <= set(doc)
    assert round(doc["checkpoint_bytes"] / 1e9) == 980 and round(doc["sync_stall_s"]) == 196


def test_monitor_once_json(capsys):
    assert cli(["monitor", "--once", "--json", "--pid", str(os.getpid())]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["dirty_threshold_bytes"] > 0 and doc["process"]["state"] in "RSD"


def _can_trace():
    return os.geteuid() == 0 and (os.path.isdir("/sys/kernel/tracing/events") or os.path.isdir("/sys/kernel/tracing"))


@pytest.mark.skipif(not _can_trace(), reason="tracefs needs root and /sys/kernel/tracing")
def test_trace_tracefs_fallback_sees_throttled_writer(tmp_path, capsys):
    """Lower the dirty limits for a few seconds so a buffered writer is throttled; restore them."""
    before = read_sysctls(["vm.dirty_bytes", "vm.dirty_background_bytes", "vm.dirty_ratio",
                           "vm.dirty_background_ratio"])
    script = (f"import os\nfd=os.open({str(tmp_path / 'f')!r}, os.O_WRONLY|os.O_CREAT)\nb=b'x'*(1<<20)\n"
              "for i in range(4000):\n  os.pwrite(fd, b, (i % 400) << 20)\n")
    writer = None
    try:
        with open("/proc/sys/vm/dirty_background_bytes", "w") as f:
            f.write(str(8 << 20))
        with open("/proc/sys/vm/dirty_bytes", "w") as f:
            f.write(str(16 << 20))
        writer = subprocess.Popen([sys.executable, "-c", script])
        rc = cli(["trace", "--seconds", "3", "--json", "--no-bpftrace"])
    finally:
        if writer is not None:
            writer.kill()
            writer.wait()
        restore_sysctls(before)
    assert read_sysctls(list(before)) == before
    if rc == 2:
        pytest.skip("tracefs could not be mounted here")
    doc = json.loads(capsys.readouterr().out)
    assert doc["method"].startswith("tracepoint")
    assert doc["events"] > 0 and doc["worst"] and doc["histogram"]
