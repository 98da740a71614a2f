"""``zerostall bench --scenario restore|many-tensors|every-step|frozen-base|objects`` at toy sizes:
each scenario's rows, verified, with the ratios it reports. No timing thresholds (the host is shared)."""

import argparse
import json

import pytest

from zerostall_bench import everystep
from zerostall_bench.frozen import METHODS
from zerostall_bench.objects import config_tree
from zerostall.cli import main as cli

pytestmark = pytest.mark.timeout(300)


def test_restore_scenario_json(bench_json):
    doc = bench_json("restore.json", "--scenario", "restore", "--size-gib", "0.01", "--repeat", "1")
    assert doc["scenario"] == "restore" and doc["repeat"] == 1 and doc["line_rate"]["read_gbps"] > 0
    res = {r["method"]: r for r in doc["results"]}
    for name in ("zerostall-threads in place", "zerostall-threads new dict", "zerostall.load-threads in place",
                 "dcp.load in place", "torch.load", "torch.load(mmap=True)+touch",
                 "zerostall.load in place (fresh process)", "dcp.load in place (fresh process)",
                 "torch.load (fresh process)"):
        r = res[name]
        assert r["verified"] is True, name
        assert r["restore_gbps"] > 0 and len(r["runs_s"]) == 1
        assert r["fraction_of_read_line_rate"] == pytest.approx(r["restore_gbps"] / doc["line_rate"]["read_gbps"])
    assert res["dcp.load in place"]["vs_dcp_load"] == pytest.approx(1.0)
    for m in ("zerostall.load in place", "dcp.load in place", "torch.load"):  # the imports timed apart
        alone, first = res[f"{m} (fresh process)"], res[f"{m} (fresh process, with its imports)"]
        assert first["verified"] is True and first["runs_s"][0] >= alone["runs_s"][0], m
    assert res["zerostall.load in place (fresh process, with its imports)"]["runs_s"][0] > \
        res["zerostall.load in place (fresh process)"]["runs_s"][0]


def test_many_tensors_scenario_json(bench_json):
    doc = bench_json("many.json", "--scenario", "many-tensors", "--tensors", "2000", "--size-gib", "0.005",
                     "--repeat", "2")
    assert doc["scenario"] == "many-tensors" and doc["tensors"] == 2000
    zs = doc["zerostall"]
    assert zs["verified"] and doc["torch_save"]["verified"] and doc["dcp"]["verified"]
    assert len(zs["stall_all_s"]) == 2 and zs["durable_s"] <= zs["result_s"]
    assert zs["disk_bytes_ratio"] >= 1.0 and doc["torch_save"]["disk_bytes_ratio"] >= 1.0
    assert set(doc["ratios"]) == {"steady_stall_vs_torch_save", "first_save_vs_torch_save", "restore_vs_torch_load",
                                  "result_vs_durable"}


# ------------------------------------------------------------------------------------------------
# ``zerostall bench --scenario every-step`` at a toy size: every mode runs, the skip mode
# reports the interval it reached, the CPU phase sits beside the one-pass limit, and every
# file it wrote is removed. No timing thresholds (the host is shared).
def test_every_step_scenario_json(tmp_path):
    out = tmp_path / "es.json"
    a = argparse.Namespace(size_gib=0.01, seconds=0.15, every=3, repeat=1, dir=str(tmp_path / "work"),
                           methods=None, json=str(out), matmuls=1, dim=64, cpu_saves=3)
    assert everystep.main(a) == 0
    doc = json.loads(out.read_text())
    assert doc["scenario"] == "every-step" and doc["state_bytes"] >= 0.009 * (1 << 30)
    assert set(doc["runs"]) == {str(t) for t in {doc["cores"], max(1, doc["cores"] - 1)}}
    for run in doc["runs"].values():
        assert set(run) == set(everystep.MODES)
        assert run["none"]["loss"] == 0 and run["none"]["saves"] == 0
        for mode in ("zs-block", "dcp-async"):  # every step saved, none skipped
            assert run[mode]["saves"] >= 1 and run[mode]["skips"] == 0 and run[mode]["interval_steps"] == 1
        skip = run["zs-skip"]
        assert skip["interval_steps"] >= 1 and skip["runs"][0]["steps"] == skip["saves"] + skip["skips"]
        k = run["zs-every-K"]
        assert k["skips"] == 0 and k["saves"] <= k["runs"][0]["steps"] // 3 + 1
        assert run["none"]["waited_s_per_step"] == 0 and run["none"]["save_cycle_s"] is None
        for mode in ("zs-block", "zs-skip", "dcp-async"):  # what explains the loss, within the run
            assert run[mode]["waited_s_per_step"] >= 0 and run[mode]["save_cycle_s"] > 0
        for mode in ("zs-block", "zs-skip"):  # the cycle holds the write
            assert 0 < run[mode]["write_s"] <= run[mode]["save_cycle_s"]
    op = doc["one_pass"]
    assert op["limit_s_per_gib"] == pytest.approx(op["copy_s_per_gib"] + op["crc_s_per_gib"]) and op["copy_s_per_gib"] > 0
    for m in ("zs-block", "dcp-async"):
        c = doc["cpu"][m]
        assert c["saves"] == 3 and c["gib"] > 0 and len(c["limits"]) == 3
        assert c["x_one_pass"] == pytest.approx(c["cpu_s_per_gib"] / c["limit_s_per_gib"])
    assert not list((tmp_path / "work").iterdir())  # every file it wrote removed


# ------------------------------------------------------------------------------------------------
# ``zerostall bench --scenario frozen-base`` at a small size: the document's structure, the
# bytes (deterministic) and the bit-exact flags. No timing thresholds (the host is shared).
def test_frozen_base_json(bench_json):
    doc = bench_json("frozen.json", "--scenario", "frozen-base", "--size-gib", "0.01", "--repeat", "2")
    assert doc["scenario"] == "frozen-base" and doc["repeat"] == 2
    assert {"cpu", "cores", "ram_bytes", "kernel", "fs"} <= set(doc["machine"])
    assert len(doc["load_avg_start"]) == 3 and doc["date_utc"]
    assert doc["frozen_fraction"] >= 0.9 and doc["frozen_bytes"] < doc["state_bytes"]
    res = {r["method"]: r for r in doc["results"]}
    assert list(res) == list(METHODS)
    for r in res.values():
        assert r["bit_exact"] is True, r["method"]
        assert r["rounds"] == 2 and len(r["durable_s_all"]) == 2
        assert r["durable_s"] > 0 and r["restore_s"] > 0 and r["restore_gbps"] > 0
        assert set(r["ratio_to_full"]) == {"bytes_written", "durable", "durable_per_round", "restore_rate"}
    assert res["zerostall-full"]["ratio_to_full"]["bytes_written"] == 1.0
    assert res["zerostall-full"]["bytes_referenced"] == 0
    for name in ("zerostall-incremental", "zerostall-incremental-version"):
        r = res[name]  # the frozen base is referenced, not written again
        assert r["bytes_referenced"] == doc["frozen_bytes"]
        assert r["ratio_to_full"]["bytes_written"] < 0.15
        assert set(doc["targets_met"][name]) == {"bytes", "durable", "restore_rate", "bit_exact"}
        assert doc["targets_met"][name]["bytes"] is True and doc["targets_met"][name]["bit_exact"] is True
    assert res["torch.save"]["bytes_written"] >= doc["state_bytes"]  # torch.save writes everything


def test_frozen_base_unknown_method(tmp_path):
    with pytest.raises(SystemExit, match="unknown method 'nope'"):
        cli(["bench", "--scenario", "frozen-base", "--methods", "nope", "--dir", str(tmp_path)])


# ------------------------------------------------------------------------------------------------
# ``zerostall bench --scenario objects`` at a small size: each state's row, verified, with the
# ratios to torch.save and json.dumps. No timing thresholds (the host is shared).
def test_objects_scenario_json(bench_json, tmp_path):
    doc = bench_json("objects.json", "--scenario", "objects", "--config-mib", "0.25", "--log-entries", "300",
                     "--repeat", "2")
    assert doc["scenario"] == "objects" and doc["log_entries"] == 300 and doc["repeat"] == 2
    for name in ("config", "log", "both"):
        r = doc[name]
        assert r["verified"] is True, name
        assert len(r["stall_all_s"]) == 2 and r["stall_s"] <= r["durable_s"] <= r["result_s"]
        assert r["json_bytes"] > 0 and r["torch_save_s"] > 0 and r["json_dumps_s"] > 0
        assert r["ratios"]["stall_vs_json_dumps"] == pytest.approx(r["stall_s"] / r["json_dumps_s"])
        assert r["probe_max_gap_s"] <= r["probe_max_gap_to_result_s"]
    assert doc["config"]["json_bytes"] >= 0.25 * (1 << 20)
    assert not list((tmp_path / "work").iterdir())  # every file it wrote removed


def test_config_tree_is_deterministic_and_about_the_size_asked():
    a, b = config_tree(0.1), config_tree(0.1)
    assert a == b and 0.1 * (1 << 20) <= len(json.dumps(a)) < 0.2 * (1 << 20)
