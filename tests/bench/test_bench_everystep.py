"""``zerostall bench --scenario every-step`` at a toy size: every mode runs, the skip mode
reports the interval it reached, the CPU phase sits beside the one-pass limit, and every
file it wrote is removed. No timing thresholds (the host is shared)."""

import argparse
import json

import pytest

from zerostall_bench import everystep

pytestmark = pytest.mark.timeout(300)


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
