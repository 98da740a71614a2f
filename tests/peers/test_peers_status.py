"""What `zerostall ls` and `zerostall doctor` say about each holder's quota for peers' copies,
from the status hint a node's leader records (peers/.status.json, written by the real
``status.record``), on a real committed root."""

import json
import os

import torch

import zerostall
from zerostall.cli.app import main
from zerostall.peers import status

MiB = 1 << 20


def _root(tmp_path):
    root = str(tmp_path / "n0")
    zerostall.save(root, {"w": torch.arange(1024.0)}, 1)
    os.makedirs(os.path.join(root, "peers", "n1", "step-1"))
    with open(os.path.join(root, "peers", "n1", "step-1", "rank-00001.shard"), "wb") as f:
        f.write(b"\0" * 4096)  # what n0 holds for n1, as its own disk says now
    usage = {
        "n0": {"used_bytes": 0, "quota_bytes": None, "next_bytes": 4096, "refused": 0},
        "n1": {"used_bytes": 10 * MiB, "quota_bytes": 100 * MiB, "next_bytes": 10 * MiB, "refused": 0},
        "n2": {"used_bytes": 60 * MiB, "quota_bytes": 100 * MiB, "next_bytes": 50 * MiB, "refused": 0},
        "n3": {"used_bytes": 40 * MiB, "quota_bytes": 100 * MiB, "next_bytes": 10 * MiB, "refused": 2},
    }
    status.record(root, "n0", 1, True, {"n0": ["n2"], "n1": ["n0"], "n2": ["n3"], "n3": ["n1"]}, [1],
                  {"n0": "127.0.0.1:9", "n1": "127.0.0.1:9", "n2": "127.0.0.1:9", "n3": "127.0.0.1:9"}, usage)
    return root


def test_quota_verdicts():
    assert status.quota_state({"used_bytes": 5, "quota_bytes": None})[1] == "none"
    assert status.quota_state({"used_bytes": 10, "quota_bytes": 100, "next_bytes": 90})[1] == "ok"
    assert status.quota_state({"used_bytes": 10, "quota_bytes": 100, "next_bytes": 91})[1] == "near"
    assert status.quota_state({"used_bytes": 101, "quota_bytes": 100, "next_bytes": 0})[1] == "over"
    text, verdict = status.quota_state({"used_bytes": 1, "quota_bytes": 100, "next_bytes": 0, "refused": 3})
    assert verdict == "over" and "3 copies refused" in text


def test_ls_shows_each_holders_quota_use(tmp_path, capsys):
    root = _root(tmp_path)
    assert main(["ls", "--json", root]) == 0
    rows = json.loads(capsys.readouterr().out)
    (own,) = [r for r in rows if r["tier"].startswith("local")]
    assert own["holders"] == ["n0", "n2"] and own["holder_usage"]["n2"]["used_bytes"] == 60 * MiB
    assert set(own["holder_usage"]) == {"n2"}  # this step's holders
    assert main(["ls", root]) == 0
    out = capsys.readouterr().out
    lines = {ln.split(":")[0].strip(): ln for ln in out.splitlines() if ln.startswith("  n")}
    assert "of peers' copies (no quota)" in lines["n0"] and "4.0 KiB" in lines["n0"]  # n0's own disk, read now
    assert "10.0 MiB of 100.0 MiB quota (10%)" in lines["n1"] and "QUOTA" not in lines["n1"]
    assert lines["n2"].endswith("NEAR QUOTA") and "the next copies need 50.0 MiB more" in lines["n2"]
    assert lines["n3"].endswith("OVER QUOTA") and "2 copies refused" in lines["n3"]
    assert "(as of step 1)" in out


def test_doctor_says_which_holder_is_near_or_over_its_quota(tmp_path):
    rows = {r[0]: r for r in status.doctor_checks(_root(tmp_path), timeout_s=0.2)}
    assert rows["peer_quota n0"][2] == "ok" and rows["peer_quota n1"][2] == "ok"
    assert rows["peer_quota n2"][2] == "warn" and "near its quota" in rows["peer_quota n2"][3]
    assert rows["peer_quota n3"][2] == "warn" and "over its quota" in rows["peer_quota n3"][3]
    assert "peers.quota_bytes" in rows["peer_quota n3"][3]


def test_ls_and_doctor_skip_a_damaged_usage_entry_instead_of_crashing(tmp_path, capsys):
    """(adv) The status hint is read leniently (bad JSON: no hint), but a usage entry whose
    numbers are not numbers (a damaged or hand-edited file, another version's) made ``zerostall
    ls`` and ``doctor`` die with a TypeError traceback; now that node's usage is reported
    as unreadable and the others as before."""
    root = _root(tmp_path)
    p = status.path(root)
    with open(p) as f:
        doc = json.load(f)
    doc["usage"]["n1"] = {"used_bytes": [1], "quota_bytes": "big"}
    doc["usage"]["n3"] = "not a dict"
    with open(p, "w") as f:
        json.dump(doc, f)
    assert main(["ls", root]) == 0
    out = capsys.readouterr().out
    assert "n1: usage unreadable" in out and "n2: 60.0 MiB of 100.0 MiB" in out
    rows = {name: (value, st) for name, value, st, _ in status.doctor_checks(root, timeout_s=0.2)}
    assert rows["peer_quota n1"] == ("usage unreadable", "warn")
    assert rows["peer_quota n2"][1] == "warn" and "peer_quota n3" not in rows
