"""zerostall.dcp: DCP's planners over zerostall's engines; resharding 4 -> 2 -> 1."""

import os
import pickle
import warnings

import pytest
import torch
import torch.distributed.checkpoint as dcp

from zerostall.dcp import Reader, Writer
from zerostall.errors import CorruptCheckpoint

from .test_distributed import _launch

warnings.filterwarnings("ignore", message=".*assuming the intent is to")


def _full():
    return torch.arange(64 * 8, dtype=torch.float32).reshape(64, 8)


@pytest.fixture(scope="module")
def saved_at_4(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("dcp")
    path = str(tmp / "ckpt")
    for rc, doc, err in _launch("dcp_save", 4, path, tmp):
        assert rc == 0, err
    return path


def test_saved_layout(saved_at_4):
    names = sorted(os.listdir(saved_at_4))
    assert names == [".metadata"] + [f"rank-{r:05d}.shard" for r in range(4)]
    assert all(os.path.getsize(os.path.join(saved_at_4, n)) % 4096 == 0 for n in names if n.endswith(".shard"))
    assert not os.path.exists(saved_at_4 + ".partial")


def test_load_at_world_2(saved_at_4, tmp_path):
    for rc, doc, err in _launch("dcp_load", 2, saved_at_4, tmp_path):
        assert rc == 0, err
        assert doc["equal"] is True


def test_load_at_world_1(saved_at_4):
    sd = {"w": torch.zeros(64, 8), "r": torch.zeros(5), "extra": {"lr": 0.0}}
    dcp.load(sd, storage_reader=Reader(saved_at_4))
    assert torch.equal(sd["w"], _full()) and torch.equal(sd["r"], torch.ones(5)) and sd["extra"]["lr"] == 0.5


def test_flipped_byte_fails_with_corruption_error(saved_at_4, tmp_path):
    import shutil
    bad = str(tmp_path / "bad")
    shutil.copytree(saved_at_4, bad)
    with open(os.path.join(bad, "rank-00001.shard"), "r+b") as f:
        f.seek(4096 + 3)
        b = f.read(1)
        f.seek(4096 + 3)
        f.write(bytes([b[0] ^ 1]))
    sd = {"w": torch.zeros(64, 8), "r": torch.zeros(5), "extra": {"lr": 0.0}}
    with pytest.raises(BaseException) as ei:  # DCP's CheckpointException derives from BaseException
        dcp.load(sd, storage_reader=Reader(bad))
    # DCP wraps per-rank failures in CheckpointException; ours is inside, with its message
    failures = getattr(ei.value, "failures", {})
    text = str(ei.value) + " ".join(f"{v!r} {getattr(v, 'exc', '')} {getattr(v, 'formatted_tb', '')}"
                                    for v in failures.values())
    assert isinstance(ei.value, CorruptCheckpoint) or "CorruptCheckpoint" in text
    assert "rank-00001.shard" in text and "crc32c" in text


def test_metadata_is_not_a_code_path(saved_at_4, tmp_path):
    import shutil

    class Evil:
        def __reduce__(self):
            return (os.system, ("touch /tmp/zerostall-dcp-pwned",))

    bad = str(tmp_path / "evil")
    shutil.copytree(saved_at_4, bad)
    with open(os.path.join(bad, ".metadata"), "wb") as f:
        pickle.dump(Evil(), f)
    with pytest.raises(CorruptCheckpoint, match="posix.system|refusing"):
        Reader(bad).read_metadata()
    assert not os.path.exists("/tmp/zerostall-dcp-pwned")


def test_async_save_single_process(tmp_path):
    path = str(tmp_path / "async")
    sd = {"a": torch.randn(1000, 7), "b": {"c": torch.arange(10)}}
    fut = dcp.async_save(sd, storage_writer=Writer(path), no_dist=True)
    (fut.upload_completion if hasattr(fut, "upload_completion") else fut).result()
    out = {"a": torch.zeros(1000, 7), "b": {"c": torch.zeros(10, dtype=torch.int64)}}
    dcp.load(out, storage_reader=Reader(path))
    assert torch.equal(out["a"], sd["a"]) and torch.equal(out["b"]["c"], sd["b"]["c"])
