"""``zerostall bench --scenario objects`` at a small size: each state's row, verified, with the
ratios to torch.save and json.dumps. No timing thresholds (the host is shared)."""

import json

import pytest

from zerostall_bench.objects import config_tree

pytestmark = pytest.mark.timeout(300)


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
