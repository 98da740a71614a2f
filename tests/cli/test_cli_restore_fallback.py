"""``zerostall restore URL`` falls back like ``load(remote=)`` does, through the same library
entry (issue 23): a newer step with a defect of any kind is reported and the previous one is
restored and verified."""

import os
import shutil

import pytest
import torch

import zerostall
from zerostall.cli import main as cli
from zerostall.store.local import LocalTier

pytestmark = pytest.mark.timeout(120)


def _remote(tmp_path):
    rem = str(tmp_path / "remote")
    zerostall.save(rem, {"w": torch.ones(4)}, step=1)
    zerostall.save(rem, {"w": torch.zeros(4)}, step=2)
    return rem


def _symlink_shard(rem):
    sh = os.path.join(rem, "step-2", "rank-00000.shard")
    shutil.copy(sh, sh + ".real")
    os.unlink(sh)
    os.symlink(sh + ".real", sh)


def _flip(rem):
    sh = os.path.join(rem, "step-2", "rank-00000.shard")
    with open(sh, "r+b") as f:
        f.seek(4096)
        b = f.read(1)
        f.seek(4096)
        f.write(bytes([b[0] ^ 1]))


def _truncate_manifest(rem):
    with open(os.path.join(rem, "step-2", "manifest.json"), "r+b") as f:
        f.truncate(10)


@pytest.mark.parametrize("damage", [_symlink_shard, _flip, _truncate_manifest], ids=["symlink", "bitflip", "manifest"])
def test_restore_falls_back_like_load(tmp_path, capsys, damage):
    rem = _remote(tmp_path)
    damage(rem)
    url = "file://" + rem
    assert zerostall.load(str(tmp_path / "by_load"), remote=url)["w"].sum() == 4  # the library falls back
    to = str(tmp_path / "to")
    assert cli(["restore", url, "--to", to]) == 0  # and so does the CLI (it exited 1 on the symlink)
    out = capsys.readouterr()
    assert "restored step 1" in out.out
    if damage is not _truncate_manifest:  # an unreadable manifest: not listed as a step at all
        assert "step 2" in out.err
    assert LocalTier(to).steps() == [1]  # nothing of step 2 left behind
    assert zerostall.load(to)["w"].sum() == 4


def test_restore_of_the_damaged_step_only_exits_1(tmp_path, capsys):
    rem = _remote(tmp_path)
    _symlink_shard(rem)
    to = str(tmp_path / "to")
    assert cli(["restore", "file://" + rem, "--to", to, "--step", "2"]) == 1
    assert "step 2" in capsys.readouterr().err
    assert LocalTier(to).steps() == []


def test_a_failed_download_leaves_a_local_copy_alone(tmp_path, capsys):
    """A local step 2 that verifies is not removed because the remote's step 2 cannot be fetched."""
    rem = _remote(tmp_path)
    to = str(tmp_path / "to")
    assert cli(["restore", "file://" + rem, "--to", to, "--step", "2"]) == 0
    _symlink_shard(rem)
    assert cli(["restore", "file://" + rem, "--to", to]) == 0  # falls back to step 1
    assert LocalTier(to).steps() == [1, 2]
    assert zerostall.load(to, step=2)["w"].sum() == 0
