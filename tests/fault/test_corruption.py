"""A flipped byte anywhere is detected; verify exits non-zero; load falls back."""

import os

import pytest
import torch

import zerostall
from zerostall.cli import main as cli
from zerostall.store.local import LocalTier
from tests.helpers import flip_byte


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
