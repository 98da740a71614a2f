"""Multi-node saves you can trust (issue 21): real processes, gloo on 127.0.0.1, every process a
node (``ZEROSTALL_NODE``) with its own root or a shared one; the c10d store hosted by this test
process, as torchrun's agent hosts it, unless a test says otherwise.

The sweep pauses a rank at a named point of the commit round (the ``fault_hook`` seam), then
signals it by pid: SIGKILL, or SIGSTOP until the others have settled the step, then SIGCONT.
Each step must end committed and verifying on every copy with every live rank durable, or
failed on every rank; never a committed step that fails verification.
"""

import json
import os
import signal
import subprocess
import sys
import time
from datetime import timedelta

import pytest

import zerostall
from zerostall.cli import main as cli
from zerostall.distributed.session import form_groups
from zerostall.errors import ConfigError
from zerostall.restore import verify_step
from zerostall.io.base import choose_engine
from zerostall.store.local import LocalTier

from ..helpers import free_port

HERE = os.path.dirname(__file__)


def _read(path):
    with open(path) as f:
        return json.load(f)


def _wait_file(path, procs, timeout=120):
    deadline = time.monotonic() + timeout
    while not os.path.exists(path):
        if time.monotonic() > deadline:
            raise AssertionError(f"{path} did not appear")
        if all(p.poll() is not None for p in procs):
            raise AssertionError(f"{path} did not appear and every rank exited")
        time.sleep(0.02)


def run(tmp_path, world, *, shared=False, agent=True, signals=(), proc_timeout=240, roots=None, settle_timeout=120,
        **args):
    """Launch ``world`` ranks of trust_worker.py; ``signals``: (rank, step, "kill"|"stop"|"hold")
    applied when that rank pauses at its fault point for that step ("hold": it stays paused
    until the next "stop" stopped its rank; a stopped rank is continued
    once every other rank wrote its outcome of the step, which must happen within
    ``settle_timeout``). Returns per-rank (returncode, result, stderr) and the roots."""
    out = tmp_path / "out"
    out.mkdir(parents=True, exist_ok=True)
    if roots is None:
        roots = [str(tmp_path / "shared")] * world if shared else [str(tmp_path / f"node{r}") for r in range(world)]
    port = free_port()
    master = None
    if agent:  # the store lives in this process, like torchrun's agent
        from torch.distributed import TCPStore
        master = TCPStore("127.0.0.1", port, world_size=None, is_master=True, wait_for_workers=False,
                          timeout=timedelta(seconds=300))
    args = dict(args, out=str(out), roots=roots)
    if not shared:
        args.setdefault("dist_name", "trust")
    procs = []
    for r in range(world):
        env = dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(r), WORLD_SIZE=str(world),
                   LOCAL_RANK="0", LOCAL_WORLD_SIZE="1", ZEROSTALL_NODE=f"node{r}", ZS_ARGS=json.dumps(args),
                   PYTHONPATH=os.pathsep.join([os.path.dirname(HERE), HERE, os.environ.get("PYTHONPATH", "")]))
        if agent:
            env["TORCHELASTIC_USE_AGENT_STORE"] = "True"
        procs.append(subprocess.Popen([sys.executable, os.path.join(HERE, "trust_worker.py")], env=env,
                                      stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True))
    try:
        held = []
        for rank, step, action in signals:
            _wait_file(str(out / f"paused-r{rank}-s{step}"), procs)
            pid = _read(out / f"paused-r{rank}-s{step}")["pid"]
            assert pid == procs[rank].pid
            if action == "hold":  # stays paused until the next "stop" has stopped its rank
                held.append(out / f"go-r{rank}-s{step}")
                continue
            if action == "kill":
                os.kill(pid, signal.SIGKILL)
                continue
            os.kill(pid, signal.SIGSTOP)
            (out / f"go-r{rank}-s{step}").touch()
            for go in held:
                go.touch()
            held.clear()
            try:
                for q in range(world):  # every other rank settles the step while this one is stopped
                    if q != rank:
                        _wait_file(str(out / f"s{step}-r{q}.json"), procs, settle_timeout)
                assert _proc_state(pid) in ("T", "t"), pid  # settled while it was still stopped
            finally:
                os.kill(pid, signal.SIGCONT)
        res = []
        for r, p in enumerate(procs):
            _, err = p.communicate(timeout=proc_timeout)
            path = out / f"r{r}.json"
            res.append((p.returncode, _read(path) if path.exists() else None, err))
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
        del master
    return res, roots


def _proc_state(pid):
    """The scheduler state letter of process ``pid`` from /proc (T: stopped)."""
    with open(f"/proc/{pid}/stat") as f:
        return f.read().rsplit(")", 1)[1].split()[0]


def _verifies(root, step):
    eng = choose_engine(root)
    try:
        verify_step(LocalTier(root), step, eng)
    finally:
        eng.close()
    return True


def check_consistent(res, roots, steps):
    """The sweep's invariant, for each step: committed in every copy and verifying, with every
    live rank durable or unknown (a rank whose deadline passed before every copy recorded the
    decision: a copy's owner stopped); or failed on every rank and committed in no copy."""
    verdicts = {}
    for step in steps:
        outs = [doc[str(step)] for _, doc, _ in res if doc is not None and str(step) in doc]
        committed = [step in LocalTier(root).steps() for root in sorted(set(roots))]
        if any(o["state"] == "durable" for o in outs):
            assert all(o["state"] in ("durable", "unknown") for o in outs), (step, outs)
            assert all(committed), (step, outs, committed)
            for root in set(roots):
                assert _verifies(root, step)
            verdicts[step] = "committed"
        else:
            assert all(o["state"] == "failed" for o in outs), (step, outs)
            assert not any(committed), (step, outs, committed)
            verdicts[step] = "failed"
    return verdicts


# -- node identity and root copies -----------------------------------------------------------------
def test_node_local_roots_every_copy_commits(tmp_path, capsys):
    """Three nodes, one host name, per-node roots: every root commits (no .partial left behind),
    files name their node, each rank restores its own part. With remote=, a fresh node
    restoring rank 1 downloads only rank 1's shard and the manifest; rank 0 restoring into the
    same root then adds its own."""
    remote = tmp_path / "remote"
    res, roots = run(tmp_path, 3, scenario="steps", steps=[1, 2], ck={"remote": f"file://{remote}"})
    for rc, doc, err in res:
        assert rc == 0, err
        assert doc["node_local"] and doc["groups"] == ["g0", "g1", "g2"]
        assert doc["1"]["state"] == doc["2"]["state"] == "durable", doc
    for r, root in enumerate(roots):
        tier = LocalTier(root)
        assert tier.steps() == [1, 2] and tier.partial_steps() == []
        man = tier.read_manifest(2)
        assert [f.host for f in man.files] == ["node0", "node1", "node2"]
        assert sorted(os.listdir(tier.step_dir(2))) == ["manifest.json", f"rank-{r:05d}.shard"]
        got = zerostall.load(root, rank=r, world_size=3)
        assert got["step"] == 2 and got["x"][0].item() == 20.0 + r
    # per-rank restore from the remote on a fresh node
    assert sorted(os.listdir(remote / "step-2")) == ["manifest.json"] + [f"rank-{r:05d}.shard" for r in range(3)]
    fresh = str(tmp_path / "fresh")
    got = zerostall.load(fresh, remote=f"file://{remote}", rank=1, world_size=3)
    assert got["step"] == 2 and got["x"][0].item() == 21.0
    assert sorted(os.listdir(os.path.join(fresh, "step-2"))) == ["manifest.json", "rank-00001.shard"]
    got = zerostall.load(fresh, remote=f"file://{remote}", rank=0, world_size=3)
    assert got["x"][0].item() == 20.0
    assert sorted(os.listdir(os.path.join(fresh, "step-2"))) == ["manifest.json", "rank-00000.shard",
                                                                  "rank-00001.shard"]
    assert zerostall.load(fresh, rank=1, world_size=3)["x"][0].item() == 21.0  # still whole for rank 1
    _verify_copies(roots, capsys)


def _verify_copies(roots, capsys):
    """``zerostall verify`` on each node's copy checks that copy's shard, names the others as held
    by other nodes (exit 0); ``--all-files`` requires them all; a copy that lost its own shard fails."""
    for r, root in enumerate(roots):
        assert cli(["verify", root, "--node", f"node{r}"]) == 0
        out = capsys.readouterr().out
        others = [n for n in range(3) if n != r]
        assert "step 2: OK" in out and f"ranks {others[0]}, {others[1]} are in other nodes' copies" in out, out
        assert cli(["verify", root, "--step", "2", "--all-files"]) == 1
        assert "shard file is missing" in capsys.readouterr().err
    os.unlink(os.path.join(LocalTier(roots[0]).step_dir(2), "rank-00000.shard"))
    assert cli(["verify", roots[0], "--step", "2", "--node", "node0"]) == 1
    assert "rank-00000.shard" in capsys.readouterr().err
    assert cli(["verify", roots[0], "--step", "1", "--node", "node0"]) == 0  # step 1 untouched


def test_mixed_shared_and_node_local_roots(tmp_path):
    """Ranks 0 and 1 share a root (one NFS export, say), rank 2 has its own: two copies, both
    commit; each holds its own ranks' shards and every rank restores its part."""
    a, b = str(tmp_path / "nfs"), str(tmp_path / "local2")
    res, roots = run(tmp_path, 3, roots=[a, a, b], scenario="steps", steps=[1])
    for rc, doc, err in res:
        assert rc == 0, err
        assert doc["node_local"] and doc["groups"] == ["g0", "g2"] and doc["1"]["state"] == "durable", doc
    assert sorted(os.listdir(LocalTier(a).step_dir(1))) == ["manifest.json", "rank-00000.shard", "rank-00001.shard"]
    assert sorted(os.listdir(LocalTier(b).step_dir(1))) == ["manifest.json", "rank-00002.shard"]
    for r, root in enumerate(roots):
        assert zerostall.load(root, rank=r, world_size=3)["x"][0].item() == 10.0 + r


def test_replicated_copies_of_two_ranks_each_hold_the_whole_state(tmp_path):
    """Replicated mode, two nodes of two ranks, one root per node: each copy's two ranks split
    the tensors between them, and each copy verifies and restores the whole state alone."""
    a, b = str(tmp_path / "nodeA"), str(tmp_path / "nodeB")
    res, roots = run(tmp_path, 4, roots=[a, a, b, b], mode="replicated", scenario="steps", steps=[1])
    for rc, doc, err in res:
        assert rc == 0, err
        assert doc["groups"] == ["g0", "g2"] and doc["1"]["state"] == "durable", doc
    for root, ranks in ((a, (0, 1)), (b, (2, 3))):
        man = LocalTier(root).read_manifest(1)
        assert [f.rank for f in man.files] == list(ranks)
        assert {t.file for t in man.tensors} == {f"rank-{r:05d}.shard" for r in ranks}  # split, not copied
        assert _verifies(root, 1)
        got = zerostall.load(root)
        assert got["x"].tolist() == [1.0] * 1000 and got["y"].tolist() == [i + 1.0 for i in range(500)]


def test_form_groups_refuses_a_view_that_is_not_an_equivalence():
    nodes = ["a", "a", "b"]
    assert form_groups([[0, 1], [0, 1], [2]], nodes, "/ck") == [[0, 1], [2]]
    assert form_groups([[0, 1, 2]] * 3, nodes, "/ck") == [[0, 1, 2]]
    with pytest.raises(ConfigError, match=r"ranks 0 \(node a\) and 1 \(node a\) disagree.*check the mounts"):
        form_groups([[0, 1], [1], [2]], nodes, "/ck")
    with pytest.raises(ConfigError, match="rank 2 .* does not see its own probe"):
        form_groups([[0, 1], [0, 1], [0, 1]], nodes, "/ck")


# -- the commit round: a sweep of stops and kills over its points --------------------------------
def test_sweep_stops_over_the_round(tmp_path):
    """Replicated mode on node-local roots (every copy holds the whole state), one step per stop:
    rank 0 stopped after preparing (2) and after deciding commit (3), rank 1 stopped before
    reporting (4) and after reporting (5), each past the others' deadline (commit_timeout_s=3).
    Steps 3 and 5 commit on both copies, but the live rank is told unknown, never durable: the
    stopped rank's copy had not recorded the decision (a kill then would have lost it there)."""
    signals = [(0, 2, "stop"), (0, 3, "stop"), (1, 4, "stop"), (1, 5, "stop")]
    pause = {"0": [["prepared", 2], ["decided", 3]], "1": [["entered", 4], ["reported", 5]]}
    res, roots = run(tmp_path, 2, mode="replicated", scenario="steps", steps=[1, 2, 3, 4, 5], timeout=3,
                     pause=pause, signals=signals)
    for rc, doc, err in res:
        assert rc == 0, err
    verdicts = check_consistent(res, roots, [1, 2, 3, 4, 5])
    assert verdicts == {1: "committed", 2: "failed", 3: "committed", 4: "failed", 5: "committed"}
    r0, r1 = res[0][1], res[1][1]
    # the missing rank is named, and only it
    assert "rank(s) 1 did not report" in r0["4"]["error"] and "rank(s) 0" not in r0["4"]["error"], r0["4"]
    assert "the coordinator (rank 0) did not decide" in r1["2"]["error"], r1["2"]
    assert r1["3"]["state"] == "unknown" and "node node0 (rank 0) did not record" in r1["3"]["error"], r1["3"]
    assert r0["5"]["state"] == "unknown" and "node node1 (rank 1) did not record" in r0["5"]["error"], r0["5"]
    assert r0["3"]["state"] == r1["5"]["state"] == "durable", (r0, r1)
    for root in roots:  # each node's copy restores the whole state on its own
        got = zerostall.load(root)
        assert got["step"] == 5 and got["x"].shape == (1000,) and got["x"][0].item() == 5.0


@pytest.mark.parametrize("rank,point,expect", [(0, "prepared", "failed"), (0, "decided", "committed"),
                                               (1, "entered", "failed"), (1, "reported", "committed")])
def test_sweep_kills_over_the_round(tmp_path, rank, point, expect):
    """A shared root, per-rank shards: SIGKILL one rank at a point of step 2's round."""
    res, roots = run(tmp_path, 2, shared=True, scenario="steps", steps=[1, 2], timeout=3, no_barrier=True,
                     pause={str(rank): [[point, 2]]}, signals=[(rank, 2, "kill")])
    assert res[rank][0] == -signal.SIGKILL
    live = [(rc, doc, err) for r, (rc, doc, err) in enumerate(res) if r != rank]
    for rc, doc, err in live:
        assert rc == 0, err
    assert check_consistent(live, roots, [1, 2]) == {1: "committed", 2: expect}


def test_coordinator_stopped_while_hosting_the_store(tmp_path):
    """A bare MASTER_ADDR launch: rank 0 hosts the store and is SIGSTOPped after reporting step 2
    ready. Rank 1 still settles step 2 at its deadline (the run() helper resumes rank 0 only
    once rank 1 wrote its outcome) -- as unknown, deleting nothing -- and rank 0 then commits
    the step complete: it verifies."""
    res, roots = run(tmp_path, 2, shared=True, agent=False, scenario="steps", steps=[1, 2], timeout=3,
                     pause={"0": [["prepared", 2]]}, signals=[(0, 2, "stop")])
    for rc, doc, err in res:
        assert rc == 0, err
    r0, r1 = res[0][1], res[1][1]
    assert r1["2"]["state"] == "unknown" and "deleted nothing" in r1["2"]["error"], r1["2"]
    assert r0["2"]["state"] == "durable", r0["2"]
    assert LocalTier(roots[0]).steps() == [1, 2] and _verifies(roots[0], 2)


def test_one_busy_rank_skips_the_step_on_every_rank(tmp_path):
    """Saves 1..5 back to back; rank 1's arena is 'busy' at step 2 (backpressure='skip'): both
    ranks skip step 2 (agreed in save(), no commit round started or left waiting), every other
    step commits, and each record says how many steps passed since the previous save. Meanwhile
    rank 0's training thread sits in a blocking wait on the default store's client:
    zerostall's own connection is not delayed."""
    res, roots = run(tmp_path, 2, shared=True, scenario="skip", steps=[1, 2, 3, 4, 5], skip_rank=1, skip_step=2,
                     timeout=20, ck={"backpressure": "skip"}, block_training_store=0)
    for rc, doc, err in res:
        assert rc == 0, err
    verdicts = check_consistent(res, roots, [1, 2, 3, 4, 5])
    # a step fails exactly when some rank skipped it (the seam's step 2; the arena may also
    # really be busy for a later one on a loaded machine): a skip never fails another step
    skipped = {s for s in range(1, 6) for _, doc, _ in res if doc[str(s)].get("error") == "skipped here"}
    assert 2 in skipped
    assert verdicts == {s: "failed" if s in skipped else "committed" for s in range(1, 6)}, (verdicts, skipped)
    for _, doc, _ in res:
        assert all(doc[str(s)].get("error") == "skipped here" for s in skipped), doc  # every rank, same steps
        assert all(doc[str(s)]["round_keys"] == [] for s in skipped), doc
        saved = [s for s in range(1, 6) if s not in skipped]
        assert [doc[str(s)]["interval"] for s in saved] == [0] + [b - a for a, b in zip(saved, saved[1:])], doc
        assert doc["3"]["interval"] == (3 - max(s for s in saved if s < 3) if 3 in saved else 2)


def test_a_rank_failing_in_save_ends_the_others_room_agreement(tmp_path):
    """backpressure='skip': rank 1's save() of step 2 raises before the room agreement (an
    unsupported leaf). Its failure report ends rank 0's wait for the agreement at once (the
    commit timeout is 600 s, the ranks' run is bounded far below it): rank 0 skips step 2, and
    the agreements of the later steps stay in step (step 3 commits on both)."""
    res, roots = run(tmp_path, 2, shared=True, scenario="skip", steps=[1, 2, 3], fail_rank=1, fail_step=2,
                     timeout=600, ck={"backpressure": "skip"}, proc_timeout=120)
    for rc, doc, err in res:
        assert rc == 0, err
    assert res[0][1]["2"]["error"] == "skipped here" and res[1][1]["2"]["error"] == "raised here"
    for _, doc, _ in res:
        assert doc["1"]["state"] == doc["3"]["state"] == "durable", doc
    assert LocalTier(roots[0]).steps() == [1, 3]


def test_rank0_leaving_after_its_with_block(tmp_path):
    """Rank 0 hosts the store and exits right after its `with` block; rank 1 reads the decision
    late: its handle still says durable (rank 0's close waited for every rank's acknowledgement)."""
    res, roots = run(tmp_path, 2, shared=True, agent=False, scenario="leave", timeout=20)
    for rc, doc, err in res:
        assert rc == 0, err
        assert doc["1"]["state"] == "durable", doc
    assert LocalTier(roots[0]).steps() == [1]


def test_replicated_shapes_compared(tmp_path):
    """Replicated mode: rank 1's tensor has another shape (same keys, same dtype): the step
    fails on both ranks naming rank 1, nothing is committed."""
    res, roots = run(tmp_path, 2, shared=True, mode="replicated", scenario="steps", steps=[1], timeout=20,
                     bad_shape_rank=1)
    for rc, doc, err in res:
        assert rc == 0, err
        assert doc["1"]["state"] == "failed" and "rank 1's state differs" in doc["1"]["error"], doc
        assert "shapes" in doc["1"]["error"]
    assert LocalTier(roots[0]).steps() == []


# -- one step for all ranks ------------------------------------------------------------------------
def test_ranks_agree_on_the_newest_step_all_can_load(tmp_path):
    """Three nodes, per-rank shards; rank 1's newest shard is damaged: every rank loads step 2
    (Checkpointer.load and zerostall.load), and says why. Then rank 0's step 1 and rank 2's
    step 2 are damaged too: every rank raises the same CheckpointNotFound naming ranks and files."""
    from tests.helpers import flip_byte
    from zerostall.format.layout import HEADER_BYTES
    res, roots = run(tmp_path / "save", 3, scenario="steps", steps=[1, 2, 3])
    for rc, doc, err in res:
        assert rc == 0, err
    flip_byte(os.path.join(roots[1], "step-3", "rank-00001.shard"), HEADER_BYTES + 8)
    res, _ = run(tmp_path / "load", 3, roots=roots, scenario="load", damage_after=[[0, 1], [2, 2]])
    seconds = set()
    for rc, doc, err in res:
        assert rc == 0, err
        assert doc["loaded"] == 2 and doc["lib_loaded"] == 2, doc
        assert doc["x0"] == 20.0 + doc["rank"]
        assert "step 3 failed on rank 1" in doc["why"] and "rank-00001.shard" in doc["why"], doc["why"]
        assert doc["second_type"] == "CheckpointNotFound", doc
        seconds.add(doc["second"])
    assert len(seconds) == 1, seconds  # the same error on every rank
    msg = seconds.pop()
    assert "no step that every rank can load" in msg
    for part in ("step 3 failed on rank 1", "step 2 failed on rank 2", "rank-00002.shard",
                 "step 1 failed on rank 0", "rank-00000.shard"):
        assert part in msg, (part, msg)
