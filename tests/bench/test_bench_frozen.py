"""``zerostall bench --scenario frozen-base`` at a small size: the document's structure, the
bytes (deterministic) and the bit-exact flags. No timing thresholds (the host is shared)."""

import pytest

from zerostall_bench.frozen import METHODS
from zerostall.cli import main as cli

pytestmark = pytest.mark.timeout(300)


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
