"""The bench's plumbing at a small size; its JSON honours the documented contract."""

import json

from zerostall_bench.bench import COLD
from zerostall.cli import main as cli

NUMERIC = ("stall_s", "staged_s", "durable_s", "persist_gbps", "fraction_of_line_rate", "dirty_peak_bytes",
           "writeback_peak_bytes", "psi_io_full_peak", "step_p50_ms", "step_p99_ms", "step_max_ms",
           "steps_over_2x_median", "rss_peak_bytes", "restore_s", "restore_gbps", "lost_s",
           "inproc_lost_s", "inproc_stall_s", "inproc_durable_s", "inproc_step_max_ms")
COLD = ("cold_stall_s", "cold_setup_s", "cold_durable_s", "cold_lost_s", "cold_rss_peak_bytes")


def test_bench_small_json_contract(bench_json, tmp_path):
    doc = bench_json("bench.json", "--size-gib", "0.0625", "--repeat", "1", "--methods",
                     "torch.save,zerostall-threads,zerostall.save,nvrx-async", "--settle-s", "0.2")
    assert doc["complete"] is True and not (tmp_path / "bench.json.tmp").exists()
    assert set(doc) >= {"machine", "size_bytes", "throttle_write_mbps", "line_rate", "memcpy_gbps", "results"}
    assert {"cpu", "ram_bytes", "kernel", "fs", "device"} <= set(doc["machine"])
    assert doc["line_rate"]["tool"] in ("fio", "probe") and doc["line_rate"]["write_gbps"] > 0
    assert doc["size_bytes"] > 60 << 20 and doc["throttle_write_mbps"] is None
    assert [r["method"] for r in doc["results"]] == ["torch.save", "zerostall-threads", "zerostall.save", "nvrx-async"]
    nvrx = doc["results"].pop()
    if nvrx.get("unavailable"):  # reported, not hidden (no CUDA or not installed)
        assert "CUDA" in nvrx["unavailable"] and nvrx["lost_s"] is None
    for r in doc["results"]:
        for k in COLD:
            assert isinstance(r[k], (int, float)) and r[k] >= 0, k
        assert r["cold_stall_s"] <= r["cold_durable_s"]
        assert r["repeats"] == 1 and r["verified"] is True
        for k in NUMERIC:
            assert isinstance(r[k], (int, float)), k
            assert isinstance(r["min"][k], (int, float)) and isinstance(r["max"][k], (int, float))
            assert r["min"][k] == r[k] == r["max"][k]  # one repeat: the summary is that sample
        assert r["stall_s"] <= r["staged_s"] <= r["durable_s"]
        for k in COLD:  # the cold scenario (a fresh process per method) ran and reported
            assert isinstance(r[k], (int, float)), (k, r[k])
    zs = doc["results"][1]
    assert zs["stall_s"] < zs["durable_s"]  # it returned before the data was durable
    assert zs["new_path_save_s"] <= zs["new_path_stall_s"]
    ts = doc["results"][0]
    assert ts["inproc_stall_s"] == ts["inproc_lost_s"]  # synchronous: no step runs during the save


def test_bench_unknown_method_is_clear(tmp_path, capsys):
    try:
        cli(["bench", "--methods", "nope", "--dir", str(tmp_path)])
    except SystemExit as exc:
        assert "unknown method" in str(exc) and "torch.save" in str(exc)
    else:
        raise AssertionError("expected SystemExit")


def test_bench_writes_partial_results_and_reports_a_failing_method(tmp_path, monkeypatch):
    """The JSON is on disk after every method (marked incomplete until the end), and a method
    that raises gets an error row while the next one still runs."""
    import zerostall_bench.bench as bench
    from zerostall_bench import methods as M

    seen = []
    real_write = bench.write_doc

    def spy(doc, path):
        real_write(doc, path)
        seen.append(json.loads(open(path).read()))

    def boom(self, step, state):
        raise RuntimeError("disk on fire")

    monkeypatch.setattr(bench, "write_doc", spy)
    monkeypatch.setattr(M.TorchSave, "save", boom)
    out = tmp_path / "bench.json"
    rc = cli(["bench", "--size-gib", "0.03", "--repeat", "1", "--methods", "torch.save,zerostall-threads",
              "--no-cold", "--no-line-rate", "--dir", str(tmp_path / "work"), "--json", str(out),
              "--settle-s", "0.1"])
    assert rc == 1  # a failed method fails the bench
    import psutil
    left = [c for c in psutil.Process().children(recursive=True)
            if "zerostall_bench.trainer" in " ".join(c.cmdline())]
    assert not left, f"the failed method's trainer process outlived it: {left}"
    assert [len(d["results"]) for d in seen[:2]] == [1, 2] and seen[0]["complete"] is False
    first = seen[0]["results"][0]
    assert first["method"] == "torch.save" and "disk on fire" in first["error"] and first["verified"] is False
    final = json.loads(out.read_text())
    assert final["complete"] is True and final["results"][1]["verified"] is True


def test_bench_without_its_package_says_how_to_install_it(monkeypatch, capsys):
    """Where zerostall_bench is not installed, ``zerostall bench`` exits 1 with the install
    command instead of a traceback; the rest of the CLI is unaffected."""
    from zerostall.cli import app
    monkeypatch.setattr(app, "bench_installed", lambda: False)
    assert cli(["bench", "--size-gib", "1"]) == 1
    err = capsys.readouterr().err
    assert "pip install -e ./bench" in err and "zerostall-bench" in err
    assert cli(["plan", "--params", "1e9"]) == 0
