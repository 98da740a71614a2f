"""Real processes, gloo on 127.0.0.1: per-rank shards, the store commit, a dead rank."""

import json
import os
import socket
import subprocess
import sys
import threading
import time

import pytest

import zerostall
from zerostall.dist.commit import commit_round
from zerostall.store.local import LocalTier

HERE = os.path.dirname(__file__)


def _port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _launch(scenario, world, ckdir, tmp_path, timeout=180):
    port = _port()
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


@pytest.mark.parametrize("world", [2, 4])
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


def test_sigkill_one_rank_mid_persist(tmp_path):
    ckdir = str(tmp_path / "ckpt")
    res = _launch("kill", 3, ckdir, tmp_path)
    assert res[2][0] == -9  # rank 2 died in its step-2 write
    for rc, doc, err in res[:2]:
        assert rc == 0, err
        assert doc["error"] and "step 2" in doc["error"]
        assert "did not report" in doc["error"] or "rank 0" in doc["error"] or "failed" in doc["error"]
        assert doc["after"] == 3.0  # the training thread kept going
    assert LocalTier(ckdir).steps() == [1]
    assert not os.path.exists(os.path.join(ckdir, "step-2"))
    for r in range(3):
        assert zerostall.load(ckdir, rank=r, world_size=3)["x"][0].item() == float(r)


def test_simulated_512_rank_commit(tmp_path, capsys):
    """512 fake ranks (threads, one store client each, as real ranks have) commit through one TCPStore."""
    from torch.distributed import TCPStore
    world = 512
    port = _port()
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
            commit_round(clients[r], "sim/0-7", r, world, frag, tier, 7, per_rank=True, timeout_s=120)
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
    del master
