"""Real processes, gloo on 127.0.0.1: per-rank shards, the store commit, a dead rank."""

import json
import os
import re
import subprocess
import sys
import threading
import time

import pytest

import zerostall
from zerostall.distributed.commit import commit_round
from zerostall.distributed.session import Session
from zerostall.distributed.store import Store
from zerostall.store.local import LocalTier

from ..helpers import free_port

HERE = os.path.dirname(__file__)


def _launch(scenario, world, ckdir, tmp_path, timeout=180):
    port = free_port()
    procs = []
    for r in range(world):
        env = dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(r), WORLD_SIZE=str(world),
                   LOCAL_RANK=str(r), LOCAL_WORLD_SIZE=str(world),
                   PYTHONPATH=os.pathsep.join([os.path.dirname(HERE), HERE, os.environ.get("PYTHONPATH", "")]))
        out = str(tmp_path / f"rank{r}.json")
        procs.append((subprocess.Popen([sys.executable, os.path.join(HERE, "dist_worker.py"), scenario, ckdir, out],
                                       env=env, stderr=subprocess.PIPE, text=True), out))
    results = []
    for p, out in procs:
        _, err = p.communicate(timeout=timeout)
        results.append((p.returncode, json.load(open(out)) if os.path.exists(out) else None, err))
    return results


@pytest.mark.parametrize("world", [2, 4, 8])
def test_per_rank_save_restore_bit_exact(tmp_path, world):
    ckdir = str(tmp_path / "ckpt")
    res = _launch("per_rank", world, ckdir, tmp_path)
    for rc, doc, err in res:
        assert rc == 0, err
        assert doc["equal"] is True
    assert res[0][1]["files"] == sorted([f"rank-{r:05d}.shard" for r in range(world)] + ["manifest.json"])
    man = LocalTier(ckdir).read_manifest(1)
    assert man.world_size == world and len(man.files) == world and man.rank_trees is not None
    # each rank's file holds that rank's state; a rank reads only its own file
    r1 = zerostall.load(ckdir, rank=1, world_size=world)
    assert r1["rank_only"].tolist() == [1.0] * 11
    with pytest.raises(zerostall.errors.CorruptCheckpoint, match="world size"):
        zerostall.load(ckdir)  # per-rank checkpoints need the same world size


def test_replicated_tensors_written_once(tmp_path):
    ckdir = str(tmp_path / "ckpt")
    res = _launch("replicated", 4, ckdir, tmp_path)
    for rc, doc, err in res:
        assert rc == 0, err
        assert doc["equal"] is True
    man = LocalTier(ckdir).read_manifest(1)
    assert len(man.files) == 4 and man.rank_trees is None
    assert len({(t.file, t.offset) for t in man.tensors}) == len(man.tensors)  # every tensor once
    assert len({t.file for t in man.tensors}) > 1  # spread over ranks
    total = sum(r[1]["bytes"] for r in res)
    single = sum(t.nbytes for t in man.tensors)
    assert total < 2 * single  # not world_size copies


def test_rank0_alone_with_local_mode(tmp_path):
    """rank-0-only saving (nanoGPT, Lightning CheckpointIO): a world of one, no store keys."""
    ckdir = str(tmp_path / "ckpt")
    res = _launch("local", 2, ckdir, tmp_path)
    for rc, doc, err in res:
        assert rc == 0, err
    doc = res[0][1]
    assert doc["equal"] is True and doc["steps"] == [1, 2] and doc["new_keys"] == 0
    man = LocalTier(ckdir).read_manifest(2)
    assert man.world_size == 1 and [f.name for f in man.files] == ["rank-00000.shard"]


def test_absent_rank_fails_setup_on_every_present_rank(tmp_path):
    """Ranks 0 and 1 open the root, rank 2 never does: both fail after join_timeout_s (3 s),
    with a ZerostallError naming rank 2 and pointing to dist_mode='local'."""
    res = _launch("absent", 3, str(tmp_path / "ckpt"), tmp_path)
    for rc, doc, err in res:
        assert rc == 0, err
    for rc, doc, err in res[:2]:
        assert doc["type"] == "DistributedError", doc
        assert "dist_mode='local'" in doc["error"]
        print(f"rank {doc['rank']} failed after {doc['elapsed_s']:.2f} s (join_timeout_s=3)")
    # rank 2 is always named; on a loaded host rank 1 may also reach the round after rank 0's
    # 3 s deadline, and is then named too (and itself reports rank 0 as gone)
    r0, r1 = res[0][1], res[1][1]
    assert r0["missing"] in ([2], [1, 2]), r0
    assert f"rank(s) {', '.join(map(str, r0['missing']))} of 3" in r0["error"]
    if r0["missing"] == [2]:
        assert r1["missing"] == [2] and "rank(s) 2 of 3" in r1["error"], r1
    else:
        assert r1["missing"] == [0] and "rank 0 did not open" in r1["error"], r1


def test_rank0_absent_fails_setup(tmp_path):
    res = _launch("no_rank0", 2, str(tmp_path / "ckpt"), tmp_path)
    for rc, doc, err in res:
        assert rc == 0, err
    doc = res[1][1]
    assert doc["type"] == "DistributedError" and "rank 0 did not open" in doc["error"]
    assert "dist_mode='local'" in doc["error"]


def test_root_owned_elsewhere_fails_every_rank_at_start(tmp_path):
    ckdir = str(tmp_path / "ckpt")
    holder = LocalTier(ckdir, create=True)
    holder.own()  # this (test) process is the root's writer
    try:
        res = _launch("locked", 2, ckdir, tmp_path)
    finally:
        holder.release()
    for rc, doc, err in res:
        assert rc == 0, err
        assert doc["type"] == "RootLockedError", doc
        assert "could not take the checkpoint root" in doc["error"] or "pid" in doc["error"]


def test_local_failure_fails_the_step_everywhere_and_the_next_commits(tmp_path):
    """Rank 1's save(2) and rank 0's save(4) raise locally (an unstorable leaf): that step fails
    on every rank through the failure report, not the 30 s commit timeout; 1, 3, 5 commit."""
    ckdir = str(tmp_path / "ckpt")
    res = _launch("local_fail", 2, ckdir, tmp_path)
    for rc, doc, err in res:
        assert rc == 0, err
        assert doc["steps"] == [1, 3, 5]
        assert doc["left_keys"] == []  # every round's store keys were deleted
        out = doc["outcomes"]
        for step in ("1", "3", "5"):
            assert out[step]["error"] is None, out[step]
    r0, r1 = res[0][1]["outcomes"], res[1][1]["outcomes"]
    assert r1["2"]["raised"] == "UnsupportedStateError" and r0["4"]["raised"] == "UnsupportedStateError"
    assert "step 2: rank 1 failed" in r0["2"]["error"] and "did not report" not in r0["2"]["error"]
    assert "step 4: rank 0 failed" in r1["4"]["error"]
    for name, out in (("rank 0", r0), ("rank 1", r1)):
        print(f"{name}: step 2 settled after {out['2']['elapsed_s']:.2f} s, step 4 after "
              f"{out['4']['elapsed_s']:.2f} s (commit_timeout_s=30)")
    for r in range(2):
        assert zerostall.load(ckdir, rank=r, world_size=2)["x"][0].item() == float(r + 5)


def test_a_rank_failing_in_its_background_object_encoding_fails_the_step_everywhere(tmp_path):
    """Rank 1's save(2) returns (its Python objects only snapshotted) and fails when they are
    encoded (an int over the bound): every rank's step 2 fails through the failure report,
    naming the key on rank 1, not by the 30 s commit timeout; 1 and 3 commit."""
    ckdir = str(tmp_path / "ckpt")
    res = _launch("background_fail", 2, ckdir, tmp_path)
    for rc, doc, err in res:
        assert rc == 0, err
        assert doc["steps"] == [1, 3]
        assert doc["outcomes"]["1"]["error"] is None and doc["outcomes"]["3"]["error"] is None
    r0, r1 = res[0][1]["outcomes"], res[1][1]["outcomes"]
    assert "'cfg.7' holds an int of 5001 bits" in r1["2"]["error"]
    assert "step 2: rank 1 failed" in r0["2"]["error"] and "did not report" not in r0["2"]["error"]


def test_sigkill_one_rank_mid_persist(tmp_path):
    ckdir = str(tmp_path / "ckpt")
    res = _launch("kill", 3, ckdir, tmp_path)
    assert res[2][0] == -9  # rank 2 died in its step-2 write
    for rc, doc, err in res[:2]:
        assert rc == 0, err
        assert doc["error"] and "step 2" in doc["error"]
        assert "did not report" in doc["error"] or "rank 0" in doc["error"], doc["error"]
        assert doc["after"] == 3.0  # the training thread kept going
        assert doc["closed"] is True
        print(f"rank {doc['rank']}: step 2 failed after {doc['elapsed_s']:.2f} s (commit_timeout_s=6)")
    # rank 2 is always named; on a loaded machine rank 1 may also miss the short timeout
    m = re.search(r"rank\(s\) ([\d, ]+) did not report", res[0][1]["error"])
    assert m is not None and "2" in m.group(1).replace(" ", "").split(","), res[0][1]["error"]
    assert LocalTier(ckdir).steps() == [1]
    assert not os.path.exists(os.path.join(ckdir, "step-2"))
    for r in range(3):
        assert zerostall.load(ckdir, rank=r, world_size=3)["x"][0].item() == float(r)


def test_simulated_512_rank_commit(tmp_path, capsys):
    """512 fake ranks (threads, one store client each, as real ranks have) commit through one TCPStore."""
    from torch.distributed import TCPStore
    world = 512
    port = free_port()
    master = TCPStore("127.0.0.1", port, world_size=None, is_master=True, wait_for_workers=False)
    clients = [None] * world
    connected = threading.Barrier(world + 1)
    tier = LocalTier(str(tmp_path / "ckpt"), create=True)
    os.makedirs(tier.partial_dir(7))
    errors = []

    def rank_fn(r):
        clients[r] = TCPStore("127.0.0.1", port, is_master=False)
        connected.wait()
        frag = {"ok": True, "n_tensors": 1, "structure": "",
                "file": {"name": f"rank-{r:05d}.shard", "rank": r, "host": "h", "file_bytes": 8192, "file_id": "x"},
                "tensors": [[0, {"key": "w", "dtype": "float32", "shape": [4], "file": f"rank-{r:05d}.shard",
                                 "offset": 4096, "nbytes": 16, "crc32c": r}]],
                "tree": {"d": [[{"v": "w"}, {"T": 0}]]}}
        try:
            session = Session("sim/0", r, world, False, (0,), ("h",), "h")
            commit_round(Store(clients[r]), session, frag, tier, 7, per_rank=True, timeout_s=120)
        except Exception as exc:  # noqa: BLE001
            errors.append((r, exc))

    threads = [threading.Thread(target=rank_fn, args=(r,)) for r in range(world)]
    for t in threads:
        t.start()
    connected.wait()
    t0 = time.perf_counter()
    for t in threads:
        t.join()
    dt = time.perf_counter() - t0
    with capsys.disabled():
        print(f"\nsimulated commit of {world} ranks through the c10d TCPStore: {dt:.2f} s")
    assert errors == []
    man = tier.read_manifest(7)
    assert len(man.files) == world and len(man.rank_trees) == world
    assert man.rank_trees[511] == {"d": [[{"v": "w"}, {"T": 511}]]}
    assert master.num_keys() == 0 or not any(master.check([f"sim/0/s7/{k}"]) for k in ("result", "ack", "r1"))
    del master


def test_remote_replicated_only_once_the_manifest_is_there(tmp_path, monkeypatch):
    """Rank 1 uploads its shard while rank 0's manifest upload is held back: rank 1 must not
    report the step replicated until the manifest is on the remote."""
    monkeypatch.setenv("ZS_REMOTE_ROOT", str(tmp_path / "remote"))
    res = _launch("remote", 2, str(tmp_path / "ckpt"), tmp_path)
    for rc, doc, err in res:
        assert rc == 0, err
        assert doc["durable"] and doc["replicated"] and doc["manifest_after"] and doc["unreplicated"] == []
    r1 = res[1][1]
    assert r1["shard_up"] and not r1["manifest_before"] and r1["replicated_before_manifest"] is False
    assert sorted(os.listdir(tmp_path / "remote" / "step-1")) == ["manifest.json", "rank-00000.shard",
                                                                  "rank-00001.shard"]
