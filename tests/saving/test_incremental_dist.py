"""Incremental saves with two real ranks (gloo on 127.0.0.1): each rank references its own
earlier files; retention, restore (local and remote), verify/ls follow the references of every
rank; a damaged referenced file of one rank fails the steps that depend on it.

Rank 0 trains a head on a frozen base (writes its head and optimizer state each step), rank 1
holds only frozen tensors (writes nothing after a full save). full_every=4: steps 1 (full),
2-4 reference 1; 5 (full), 6 references 5; after a restart, 200 references 5.
"""

import json
import os
import subprocess
import sys

import pytest

import zerostall
from zerostall.cli import main as cli
from zerostall.config import IOConfig
from zerostall.errors import CorruptCheckpoint
from zerostall.format.layout import HEADER_BYTES
from zerostall.io import get_engine
from zerostall.restore import verify_step
from zerostall.store.local import LocalTier
from zerostall.store.tier import open_tier
from tests.helpers import flip_byte

from ..helpers import free_port

pytestmark = pytest.mark.timeout(300)
HERE = os.path.dirname(__file__)
SHARDS = ("rank-00000.shard", "rank-00001.shard")


def _launch(ckdir, tmp_path, world=2, **env_extra):
    port = free_port()
    procs = []
    for r in range(world):
        env = dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(r), WORLD_SIZE=str(world),
                   LOCAL_RANK=str(r), LOCAL_WORLD_SIZE=str(world), **env_extra,
                   PYTHONPATH=os.pathsep.join([os.path.dirname(HERE), HERE, os.environ.get("PYTHONPATH", "")]))
        out = str(tmp_path / f"rank{r}.json")
        procs.append((subprocess.Popen([sys.executable, os.path.join(HERE, "incr_dist_worker.py"), ckdir, out],
                                       env=env, stderr=subprocess.PIPE, text=True), out))
    errs = []
    for p, _ in procs:
        try:
            errs.append(p.communicate(timeout=240)[1])
        except subprocess.TimeoutExpired:
            p.kill()
            errs.append("TIMEOUT\n" + p.communicate()[1])
    for r, (p, _) in enumerate(procs):  # every rank's stderr: the failing one may not be the first
        assert p.returncode == 0, "\n".join(f"--- rank {i} (rc {q.returncode}):\n{e[-3000:]}"
                                             for i, ((q, _), e) in enumerate(zip(procs, errs)))
    return [json.load(open(out)) for _, out in procs]


def _verify(ckdir, step):
    eng = get_engine("threads", IOConfig())
    try:
        return verify_step(LocalTier(ckdir), step, eng)
    finally:
        eng.close()


_flip = flip_byte


@pytest.mark.parametrize("mode", ["crc", "version"])
def test_two_ranks_reference_their_own_files(tmp_path, mode, capsys):
    ckdir = str(tmp_path / "ckpt")
    r0, r1 = _launch(ckdir, tmp_path, ZS_MODE=mode, ZS_DIST_MODE="per_rank", ZS_KEEP_LAST="4")
    rec0 = {int(k): v for k, v in r0["records"].items()}
    rec1 = {int(k): v for k, v in r1["records"].items()}
    emb, tower = 256 * 64 * 4, (128 * 256 + 256) * 4  # rank 0's frozen embedding, rank 1's tensors
    # rank 1 changes nothing: after a full save it references everything; rank 0 only its frozen base
    for s in (2, 3, 4, 6, 200):
        assert rec1[s]["referenced"] == tower and rec1[s]["written"] == HEADER_BYTES, s  # a bare header
        assert rec0[s]["referenced"] == emb and 0 < rec0[s]["written"] < rec0[1]["written"], s
    for s in (1, 5):  # full_every=4
        assert rec0[s]["referenced"] == rec1[s]["referenced"] == 0
    # keep_last=4 plus the steps kept ones reference (step 1 for 3 and 4), on every rank's account
    assert r0["steps_before_restart"] == [1, 3, 4, 5, 6]
    assert r0["steps"] == r1["steps"] == [1, 4, 5, 6, 200]
    for doc in (r0, r1):  # every kept step loads bit-exact on both ranks
        assert doc["equal"] == {str(s): True for s in doc["steps"]}
    tier = LocalTier(ckdir)
    for s, base in ((4, 1), (6, 5), (200, 5)):
        man = tier.read_manifest(s)
        assert {(r.step, r.name, r.rank) for r in man.ref_files} == {(base, n, i) for i, n in enumerate(SHARDS)}
        for e in man.tensors:  # a rank borrows only from its own file
            assert e.file in SHARDS
        assert man.world_size == 2 and man.format_version == 3
    assert cli(["verify", ckdir]) == 0
    capsys.readouterr()
    assert cli(["ls", ckdir, "--json"]) == 0
    rows = {r["step"]: r for r in json.loads(capsys.readouterr().out)}
    assert rows[200]["references_steps"] == [5]
    assert rows[200]["bytes_referenced"] == rec0[200]["referenced"] + rec1[200]["referenced"]
    assert rows[5]["bytes_referenced"] == 0

    # rank 1's file of step 5 is damaged: 5, 6 and 200 (which borrow from it) fail; 1 and 4 verify
    _flip(os.path.join(ckdir, "step-5", SHARDS[1]), HEADER_BYTES + 17)
    for s in (5, 6, 200):
        with pytest.raises(CorruptCheckpoint, match="step-5"):
            _verify(ckdir, s)
    for s in (1, 4):
        _verify(ckdir, s)
    assert cli(["verify", ckdir]) == 1
    rep = zerostall.LoadReport()
    got = zerostall.load(ckdir, rank=1, world_size=2, report=rep)
    assert rep.step == 4 and got["step"] == 4  # rank 1 falls back past every step that needs the bad bytes


def test_two_ranks_replicated_mode(tmp_path):
    """dist_mode="replicated": the same state on both ranks, each writes (and later references) its share."""
    ckdir = str(tmp_path / "ckpt")
    r0, r1 = _launch(ckdir, tmp_path, ZS_MODE="crc", ZS_DIST_MODE="replicated", ZS_KEEP_LAST="10")
    assert r0["steps"] == [1, 2, 3, 4, 5, 6, 200]
    for doc in (r0, r1):
        assert doc["equal"] == {str(s): True for s in doc["steps"]}
    man = LocalTier(ckdir).read_manifest(3)
    assert {r.step for r in man.ref_files} == {1}
    assert {r.name for r in man.ref_files} == set(SHARDS)  # the frozen tensors of both ranks' shares
    assert sum(d["records"]["3"]["referenced"] for d in (r0, r1)) >= 40000 * 4 + 256 * 64 * 4
    assert cli(["verify", ckdir]) == 0


def test_two_ranks_remote_tier(tmp_path):
    """Each file goes up once, with the step that wrote it; a remote restore into an empty
    directory fetches what the step borrows, for each rank."""
    ckdir, root = str(tmp_path / "ckpt"), tmp_path / "remote"
    url = f"file://{root}"
    r0, r1 = _launch(ckdir, tmp_path, ZS_MODE="crc", ZS_DIST_MODE="per_rank", ZS_KEEP_LAST="4", ZS_REMOTE=url)
    for doc in (r0, r1):
        assert doc["replicated"] is True and doc["unreplicated"] == []
        assert doc["remote_equal"] is True
    remote = open_tier(url)
    assert remote.steps() == [5, 200]  # keep_last_remote=1, and 200 borrows from 5
    man = remote.read_manifest(200)
    assert {(r.step, r.name) for r in man.ref_files} == {(5, n) for n in SHARDS}
    # step 200's own files hold only what changed: rank 1's is a bare header
    assert os.path.getsize(root / "step-200" / SHARDS[1]) == HEADER_BYTES
    assert sorted(os.listdir(root / "step-5")) == sorted(SHARDS + ("manifest.json",))
    assert cli(["verify", url]) == 0
