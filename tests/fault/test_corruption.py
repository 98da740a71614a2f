"""A flipped byte anywhere is detected; verify exits non-zero; load falls back."""

import json
import os
import shutil
import subprocess
import sys
import time

import pytest
import torch

import zerostall
from tests.helpers import flip_byte
from zerostall import LoadReport
from zerostall.cli import main as cli
from zerostall.cli.app import main
from zerostall.format.manifest import MANIFEST_NAME
from zerostall.restore import FETCH_LOCK_NAME
from zerostall.store.local import LocalTier
from zerostall.store.sharedfs import FileTier
from zerostall.store.tier import open_tier


def _two_steps(ckdir):
    with zerostall.Checkpointer(ckdir) as c:
        c.save(1, {"w": torch.full((5000,), 1.0), "b": torch.arange(3)}).result()
        c.save(2, {"w": torch.full((5000,), 2.0), "b": torch.arange(3) * 2}).result()
    return os.path.join(ckdir, "step-2", "rank-00000.shard")


def _flip(path, pos):
    flip_byte(path, pos, 0x10)


# header, payload start, payload middle, second tensor (w at 4096..24096, b right after it,
# 24 bytes), the padding after it, the last byte of the file (padding to 24576)
@pytest.mark.parametrize("pos", (0, 100, 4096, 4096 + 9999, 24096 + 5, 24096 + 24 + 3, 24575))
def test_flipped_shard_byte_detected(ckdir, pos, capsys):
    shard = _two_steps(ckdir)
    assert pos < os.path.getsize(shard)
    offsets = {e.key: e.offset for e in LocalTier(ckdir).read_manifest(2).tensors}
    assert offsets == {"w": 4096, "b": 24096}
    _flip(shard, pos)
    assert cli(["verify", ckdir, "--step", "2"]) == 1
    err = capsys.readouterr().err
    assert "rank-00000.shard" in err and "step 2: FAILED" in err
    out = zerostall.load(ckdir)
    assert out["w"][0].item() == 1.0  # fell back to step 1
    with pytest.raises(zerostall.errors.CorruptCheckpoint):
        zerostall.load(ckdir, fallback=False)


def test_crc_failure_names_the_tensor(ckdir, capsys):
    shard = _two_steps(ckdir)
    _flip(shard, 4096 + 8)
    assert cli(["verify", ckdir]) == 1
    err = capsys.readouterr().err
    assert "'w'" in err and "crc32c" in err and "step 1: FAILED" not in err


def test_flipped_manifest_byte_detected(ckdir):
    _two_steps(ckdir)
    man = os.path.join(ckdir, "step-2", "manifest.json")
    size = os.path.getsize(man)
    for pos in range(0, size, max(1, size // 25)):
        with open(man, "rb") as f:
            orig = f.read()
        _flip(man, pos)
        assert cli(["verify", ckdir, "--step", "2"]) == 1
        assert zerostall.load(ckdir)["w"][0].item() == 1.0
        with open(man, "wb") as f:
            f.write(orig)
    assert cli(["verify", ckdir]) == 0


def test_truncated_missing_swapped_symlinked(ckdir, tmp_path):
    shard = _two_steps(ckdir)
    other = os.path.join(ckdir, "step-1", "rank-00000.shard")
    data = open(shard, "rb").read()
    # truncated
    with open(shard, "r+b") as f:
        f.truncate(8192)
    assert zerostall.load(ckdir)["w"][0].item() == 1.0
    # swapped with step 1's shard (same size): header names another checkpoint
    os.unlink(shard)
    os.link(other, shard)
    with pytest.raises(zerostall.errors.CorruptCheckpoint, match="another checkpoint|does not match"):
        zerostall.load(ckdir, step=2)
    # symlink pointing outside the checkpoint
    os.unlink(shard)
    outside = tmp_path / "outside"
    outside.write_bytes(data)
    os.symlink(outside, shard)
    with pytest.raises(zerostall.errors.CorruptCheckpoint, match="symlink|regular"):
        zerostall.load(ckdir, step=2)
    # missing
    os.unlink(shard)
    with pytest.raises(zerostall.errors.CorruptCheckpoint, match="missing"):
        zerostall.load(ckdir, step=2)
    assert zerostall.load(ckdir)["w"][0].item() == 1.0


def test_nothing_verifies(ckdir):
    shard = _two_steps(ckdir)
    _flip(shard, 5000)
    _flip(os.path.join(ckdir, "step-1", "rank-00000.shard"), 5000)
    with pytest.raises(zerostall.errors.CorruptCheckpoint, match="no checkpoint .* verifies"):
        zerostall.load(ckdir)


def test_single_bit_flips_across_the_whole_shard(ckdir):
    """48 single-bit flips spread over header, payloads, padding and tail: every one is caught."""
    shard = _two_steps(ckdir)
    size = os.path.getsize(shard)
    orig = open(shard, "rb").read()
    for k in range(48):
        pos = (k * 7919 * 13) % size
        with open(shard, "r+b") as f:
            f.seek(pos)
            f.write(bytes([orig[pos] ^ (1 << (k % 8))]))
        assert cli(["verify", ckdir, "--step", "2"]) == 1, f"flip at {pos} missed"
        assert zerostall.load(ckdir)["w"][0].item() == 1.0
        with open(shard, "r+b") as f:
            f.seek(pos)
            f.write(orig[pos:pos + 1])
    assert cli(["verify", ckdir]) == 0


# ---- concurrent_restore: Processes restoring from the remote into one local directory at once (the ranks of a node
# calling ``load(node_dir, remote=...)``) all load the newest step.
#
# Each used to remove the others' ``step-N.partial`` and swap their commits away, so some
# raised CorruptCheckpoint ("no checkpoint verifies") or silently loaded an older step. The
# seam: the remote's first download, once done, starts a second restore (another process) into the same
# directory and waits until it has finished or is waiting for the first one (a blocked
# ``flock`` shows in /proc/locks).


SECOND = """
import sys, zerostall
from zerostall import LoadReport
r = LoadReport()
got = zerostall.load(sys.argv[1], remote=sys.argv[2], report=r)
print(r.step, float(got["a"][0]), len(r.failed))
"""


def _waiting_on(path):
    """True if some process waits for a flock on ``path`` (a '->' line in /proc/locks)."""
    try:
        ino = os.stat(path).st_ino
    except FileNotFoundError:
        return False
    with open("/proc/locks") as f:
        return any("->" in line and line.split()[-3].endswith(f":{ino}") for line in f)


class _StartsASecondRestore:
    def __init__(self, inner, root, url):
        self.inner, self.root, self.url, self.second = inner, root, url, None

    def download(self, rel, local_path, size):
        self.inner.download(rel, local_path, size)
        if self.second is None:  # downloaded, not yet committed
            self.second = subprocess.Popen([sys.executable, "-c", SECOND, self.root, self.url],
                                           stdout=subprocess.PIPE, text=True)
            deadline = time.monotonic() + 120  # only a bound against hanging: either outcome ends it sooner
            while self.second.poll() is None and not _waiting_on(os.path.join(self.root, FETCH_LOCK_NAME)):
                assert time.monotonic() < deadline, "the second restore neither finished nor waited"
                time.sleep(0.05)

    def __getattr__(self, name):
        return getattr(self.inner, name)


@pytest.mark.timeout(300)
def test_two_processes_restoring_into_one_directory(tmp_path):
    url = f"file://{tmp_path / 'remote'}"
    with zerostall.Checkpointer(str(tmp_path / "writer"), remote=url) as ck:
        ck.save(1, {"a": torch.full((1 << 16,), 1.0)})
        ck.save(2, {"a": torch.full((1 << 16,), 2.0)})
    root = str(tmp_path / "node")
    remote = _StartsASecondRestore(open_tier(url), root, url)
    report = LoadReport()
    got = zerostall.load(root, remote=remote, report=report)
    out, _ = remote.second.communicate(timeout=120)
    assert remote.second.returncode == 0
    assert (report.step, report.failed) == (2, [])
    assert torch.equal(got["a"], torch.full((1 << 16,), 2.0))
    assert out.split() == ["2", "2.0", "0"]


# ---- damaged_manifest_listing: A step whose manifest.json is not a regular file (FIFO, directory, symlink, dangling
# symlink) or whose step directory is a symlink is listed as damaged by ``ls`` and makes
# ``verify`` exit 1 naming the file, on the local tier and on a shared-filesystem tier; nothing
# hangs on a FIFO. The old listing skipped such steps, so ``verify`` printed OK.


def _fifo(p):
    os.mkfifo(p)


def _dir(p):
    os.mkdir(p)


def _symlink(p):
    shutil.copy(p + ".orig", p + ".elsewhere")
    os.symlink(p + ".elsewhere", p)


def _dangling(p):
    os.symlink(p + ".nowhere", p)


DAMAGE = {"fifo": _fifo, "dir": _dir, "symlink": _symlink, "dangling": _dangling}


def _root(tmp_path):
    d = str(tmp_path / "ck")
    for s in (1, 2):
        zerostall.save(d, {"w": torch.full((64,), float(s))}, step=s)
    return d


@pytest.mark.timeout(120)
@pytest.mark.parametrize("kind", sorted(DAMAGE) + ["step_dir_symlink"])
@pytest.mark.parametrize("where", ["local", "file"])
def test_damaged_manifest_is_listed_and_fails_verify(tmp_path, capsys, kind, where):
    d = _root(tmp_path)
    man = os.path.join(d, "step-2", MANIFEST_NAME)
    if kind == "step_dir_symlink":  # a whole step directory that lives elsewhere
        os.rename(os.path.join(d, "step-2"), str(tmp_path / "outside"))
        os.symlink(str(tmp_path / "outside"), os.path.join(d, "step-2"))
    else:
        os.rename(man, man + ".orig")
        DAMAGE[kind](man)
    arg = d if where == "local" else f"file://{d}"

    assert main(["verify", arg]) == 1
    out, err = capsys.readouterr()
    assert "step 1: OK" in out
    assert "step 2: FAILED" in err and "step-2" in err, err

    assert main(["ls", "--json", arg]) == 0
    rows = {r["step"]: r for r in json.loads(capsys.readouterr().out)}
    assert sorted(rows) == [1, 2]
    assert rows[1]["state"] == "committed"
    assert rows[2]["state"].startswith("invalid manifest") and "step-2" in rows[2]["state"]

    tier = LocalTier(d) if where == "local" else FileTier(arg)
    assert tier.listed_steps() == [1, 2]
    assert tier.steps() == [1]  # never counted as committed (retention, load)
    assert zerostall.load(d)["w"][0].item() == 1.0  # load falls back to step 1
