"""Housekeeping on holders (issue 32, items 4, 11, 12, 13, 14): 3 simulated nodes x 1 rank (real
processes, gloo), replicas=2, keep_last=2, one process group running three Checkpointers in
turn on the same roots (two restarts), ``zerostall delete`` and a restart; ``zerostall ls``
on a holder."""

import json
import os
import shutil

from zerostall.cli.app import main as cli
from zerostall.format.manifest import MANIFEST_NAME

from .test_peers import _launch, _ok


def test_holders_keep_last_across_restarts_incremental_and_duplicate_names(tmp_path, capsys):
    """Rank 2 first starts as node 'n1' with a root of its own: refused on every rank, naming
    ranks 1 and 2. Then (n0, n1, n2): steps 1-3; a restart and step 4: every holder keeps steps
    3 and 4 of each source (keep_last=2 across the restart, not only the newest); a restart with
    incremental="crc" and steps 5-8 (6-8 borrow 5's frozen tensor): every step protected, the
    watcher alive, holders keep 7, 8 and the step they reference."""
    base = str(tmp_path / "job")
    docs = _ok(_launch("holders", base, tmp_path, {}, nodes=["n0", "n1", "n1"], worker="holders_worker.py",
                       timeout=240))
    bad = []  # every property checked, all failures reported together
    for d in docs:
        if d.get("dup_type") != "ConfigError" or "ranks 1, 2 all call their node 'n1'" not in d["dup_error"]:
            bad.append(f"duplicate node names accepted or unnamed on rank {d['rank']}: {d.get('dup_error')}")
        if d["run1"] != {"1": True, "2": True, "3": True} or d["run2"] != {"4": True}:
            bad.append(f"rank {d['rank']}: runs 1-2 not protected: {d['run1']} {d['run2']}")
        if d["watcher_alive"] is not True or d["run3"] != {"5": True, "6": True, "7": True, "8": True}:
            bad.append(f"rank {d['rank']}: incremental run: watcher alive {d['watcher_alive']}, {d['run3']}")
    holdings = [d["held_after_run2"] for d in docs]
    if sum(len(h) for h in holdings) != 3 or any(steps != [3, 4] for h in holdings for steps in h.values()):
        bad.append(f"after the restart and step 4 the holders keep {holdings}, not steps 3 and 4 of each source")
    holdings = [d["held_after_run3"] for d in docs]
    if any(steps != [5, 7, 8] for h in holdings for steps in h.values()):
        bad.append(f"after the incremental run the holders keep {holdings}, not 7, 8 and the referenced 5")
    assert not bad, "\n".join(bad)
    # `zerostall delete` of step 8 on the roots of n0 and n1 (n2's is not reached): the restart
    # resumes from step 7 on every rank -- step 8 is not fetched back from n2, which holds
    # n0's copy of it -- and n2 drops that copy at start-up (n0's tombstone)
    assert os.path.isdir(os.path.join(base, "root2", "peers", "n0", "step-8"))
    capsys.readouterr()
    assert cli(["delete", os.path.join(base, "root0"), os.path.join(base, "root1"), "--step", "8"]) == 0
    out = capsys.readouterr().out
    assert "removed step 8 from" in out and "removed the copy of node n1's step 8" in out, out
    docs = _ok(_launch("load", base, tmp_path, {}, nodes=["n0", "n1", "n2"], worker="holders_worker.py"))
    assert [(d.get("step"), d.get("equal")) for d in docs] == [(7, True)] * 3, docs
    assert docs[2]["held"] == {"n0": [5, 7]}, docs[2]


def test_ls_lists_no_manifest_only_copy(tmp_path, capsys):
    """A copy cut before any byte arrived (only its manifest written) is not a held copy:
    `zerostall ls` on the holder does not list it as a 0 B "held for node" row."""
    import torch

    import zerostall
    root = str(tmp_path / "n1")
    zerostall.save(root, {"x": torch.ones(4)}, step=1)
    for step, shard in ((1, True), (2, False)):
        d = os.path.join(root, "peers", "n0", f"step-{step}")
        os.makedirs(d)
        shutil.copy(os.path.join(root, "step-1", MANIFEST_NAME), os.path.join(d, MANIFEST_NAME))
        if shard:
            shutil.copy(os.path.join(root, "step-1", "rank-00000.shard"), d)
    capsys.readouterr()
    assert cli(["ls", "--json", root]) == 0
    rows = json.loads(capsys.readouterr().out)
    held = [r for r in rows if r["tier"].startswith("peer copy")]
    assert [r["step"] for r in held] == [1] and held[0]["bytes"] > 0, rows
