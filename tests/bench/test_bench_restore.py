"""``zerostall bench --scenario restore`` at a small size: every method's row, bit-exact, and
the fractions of the read line rate and of dcp.load. No timing thresholds (the host is shared)."""

import pytest

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
