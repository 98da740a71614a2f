"""Hostile DCP checkpoints: every malformed ``.metadata`` or record gives CorruptCheckpoint naming
the file and the field, before anything is allocated; nothing hangs, nothing raw escapes."""

import dataclasses
import os
import pickle
import shutil

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex

from zerostall.dcp import Reader, Writer
from zerostall.errors import CorruptCheckpoint

pytestmark = [pytest.mark.timeout(60), pytest.mark.filterwarnings("ignore::UserWarning")]


def _state():
    return {"w": torch.arange(40, dtype=torch.float32).reshape(10, 4), "b": torch.ones(3, dtype=torch.int64),
            "obj": {"lr": 0.5}}


@pytest.fixture(scope="module")
def good(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("good") / "ck")
    dcp.save(_state(), storage_writer=Writer(path), no_dist=True)
    return path


@pytest.fixture(scope="module")
def good_fsw(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("goodfsw") / "ck")
    dcp.save(_state(), storage_writer=dcp.FileSystemWriter(path), no_dist=True)
    return path


def _copy(src, tmp_path):
    dst = str(tmp_path / "bad")
    shutil.copytree(src, dst)
    return dst


def _md(path):
    with open(os.path.join(path, ".metadata"), "rb") as f:
        return pickle.load(f)  # the test's own file: trusted here


def _put(path, md):
    with open(os.path.join(path, ".metadata"), "wb") as f:
        pickle.dump(md, f)


def _record(md, fqn):
    return next(k for k in md.storage_data if k.fqn == fqn)


def _edit_record(path, fqn, **changes):
    md = _md(path)
    k = _record(md, fqn)
    md.storage_data[k] = dataclasses.replace(md.storage_data[k], **changes)
    _put(path, md)


def _refused(path, *needles):
    """Reader.read_metadata raises CorruptCheckpoint naming the file and field; dcp.load fails with it."""
    with pytest.raises(CorruptCheckpoint) as ei:
        Reader(path).read_metadata()
    msg = str(ei.value)
    for n in needles:
        assert n in msg, msg
    out = {"w": torch.zeros(10, 4), "b": torch.zeros(3, dtype=torch.int64), "obj": {"lr": 0.0}}
    with pytest.raises(BaseException) as ei2:  # DCP wraps storage errors in CheckpointException
        dcp.load(out, storage_reader=Reader(path), no_dist=True)
    assert msg in str(ei2.value)  # our message, not a raw OSError/TypeError, reaches the caller
    assert "rank local metadata read failed" not in str(ei2.value) or msg in str(ei2.value).split("rank local")[1]
    return msg


# -- records -------------------------------------------------------------------------------------
@pytest.mark.parametrize("field,value,needle", [
    ("nbytes", 2 ** 60, "nbytes"),                    # huge: never allocated
    ("nbytes", -1, "nbytes"),
    ("nbytes", 1e3, "nbytes"),                        # a float
    ("offset", -4096, "offset"),
    ("offset", "4096", "offset"),                     # a string
    ("offset", True, "offset"),                       # a bool is not an offset
    ("offset", 4096 + 1, "unaligned"),
    ("offset", 2 ** 70, "offset"),                    # overflow territory
    ("crc32c", 2 ** 33, "crc32c"),
    ("shape", (10, 5), "shape"),                      # 50 elements, 160 bytes recorded
    ("shape", (2 ** 40, 2 ** 40, 0), "shape"),        # zero elements but absurd dims
    ("shape", "10x4", "shape"),
    ("dtype", "float128", "dtype"),
    ("dtype", "int32", "holds"),                      # a valid dtype that disagrees with DCP's metadata
    ("file", "../../etc/passwd", "file"),
    ("file", "rank-00000-aaaaaaaaaaaa.shard", "missing"),
    ("file_bytes", 2 ** 50, "bytes"),                 # file is smaller than the records say
    ("file_bytes", 4097, "multiple"),
    ("rank", -2, "rank"),
    ("file_id", b"bytes", "file_id"),
])
def test_bad_record(good, tmp_path, field, value, needle):
    path = _copy(good, tmp_path)
    _edit_record(path, "w", **{field: value})
    msg = _refused(path, needle)
    assert ".metadata" in msg or "rank-" in msg


def test_overlapping_records(good, tmp_path):
    path = _copy(good, tmp_path)
    md = _md(path)
    w, b = md.storage_data[_record(md, "w")], _record(md, "b")
    md.storage_data[b] = dataclasses.replace(md.storage_data[b], file=w.file, offset=w.offset, file_id=w.file_id,
                                             rank=w.rank, file_bytes=w.file_bytes)
    _put(path, md)
    _refused(path, "overlaps")


def test_record_of_wrong_type(good, tmp_path):
    path = _copy(good, tmp_path)
    md = _md(path)
    md.storage_data[_record(md, "w")] = {"file": "x"}
    _put(path, md)
    _refused(path, ".metadata", "mixes storage records")


def test_chunk_without_record(good, tmp_path):
    path = _copy(good, tmp_path)
    md = _md(path)
    del md.storage_data[_record(md, "w")]
    _put(path, md)
    _refused(path, "state_dict_metadata['w']", "no storage record")


def test_chunk_outside_tensor(good, tmp_path):
    path = _copy(good, tmp_path)
    md = _md(path)
    md.state_dict_metadata["w"].chunks[0] = ChunkStorageMetadata(offsets=torch.Size([5, 0]), sizes=torch.Size([10, 4]))
    _put(path, md)
    _refused(path, "state_dict_metadata['w'].chunks[0]")


def test_storage_key_not_an_index(good, tmp_path):
    path = _copy(good, tmp_path)
    md = _md(path)
    k = _record(md, "b")
    md.storage_data["b"] = md.storage_data.pop(k)
    _put(path, md)
    _refused(path, "MetadataIndex")


def test_metadata_not_metadata(good, tmp_path):
    path = _copy(good, tmp_path)
    _put(path, [1, 2, 3])
    _refused(path, ".metadata", "not DCP metadata")


def test_metadata_truncated(good, tmp_path):
    path = _copy(good, tmp_path)
    p = os.path.join(path, ".metadata")
    raw = open(p, "rb").read()
    with open(p, "wb") as f:
        f.write(raw[: len(raw) // 2])
    _refused(path, ".metadata", "unreadable")


def test_state_dict_metadata_not_a_dict(good, tmp_path):
    path = _copy(good, tmp_path)
    md = _md(path)
    md.state_dict_metadata = [("w", 1)]
    _put(path, md)
    _refused(path, "state_dict_metadata")


# -- the .metadata file itself and the shard files --------------------------------------------------
def test_metadata_fifo_does_not_hang(good, tmp_path):
    path = _copy(good, tmp_path)
    os.unlink(os.path.join(path, ".metadata"))
    os.mkfifo(os.path.join(path, ".metadata"))
    _refused(path, ".metadata", "not a regular file")


def test_metadata_directory(good, tmp_path):
    path = _copy(good, tmp_path)
    os.unlink(os.path.join(path, ".metadata"))
    os.mkdir(os.path.join(path, ".metadata"))
    _refused(path, ".metadata", "not a regular file")


def test_metadata_symlink(good, tmp_path):
    path = _copy(good, tmp_path)
    target = str(tmp_path / "elsewhere")
    os.rename(os.path.join(path, ".metadata"), target)
    os.symlink(target, os.path.join(path, ".metadata"))
    _refused(path, ".metadata", "symlink")


def test_shard_fifo_and_symlink(good, tmp_path):
    path = _copy(good, tmp_path)
    shard = _md(path).storage_data[_record(_md(path), "w")].file
    os.rename(os.path.join(path, shard), str(tmp_path / "real"))
    os.symlink(str(tmp_path / "real"), os.path.join(path, shard))
    _refused(path, shard, "not a regular file")
    os.unlink(os.path.join(path, shard))
    os.mkfifo(os.path.join(path, shard))
    _refused(path, shard, "not a regular file")


def test_shard_truncated(good, tmp_path):
    path = _copy(good, tmp_path)
    shard = _md(path).storage_data[_record(_md(path), "w")].file
    os.truncate(os.path.join(path, shard), 4096)
    _refused(path, shard, "truncated")


# -- FileSystemWriter checkpoints read by zerostall's Reader --------------------------------------
@pytest.mark.parametrize("changes,needle", [
    ({"relative_path": "/etc/passwd"}, "relative_path"),
    ({"relative_path": "../x.distcp"}, "relative_path"),
    ({"relative_path": ".metadata"}, "relative_path"),
    ({"length": 2 ** 62}, "outside"),
    ({"offset": -1}, "offset"),
    ({"offset": "0"}, "offset"),
])
def test_bad_filesystemwriter_record(good_fsw, tmp_path, changes, needle):
    path = _copy(good_fsw, tmp_path)
    md = _md(path)
    k = _record(md, "w")
    assert isinstance(md.storage_data[k], _StorageInfo)
    md.storage_data[k] = dataclasses.replace(md.storage_data[k], **changes)
    _put(path, md)
    _refused(path, needle)


def test_good_ones_load(good, good_fsw):
    for p in (good, good_fsw):
        out = {"w": torch.zeros(10, 4), "b": torch.zeros(3, dtype=torch.int64), "obj": {"lr": 0.0}}
        dcp.load(out, storage_reader=Reader(p), no_dist=True)
        assert torch.equal(out["w"], _state()["w"]) and out["obj"]["lr"] == 0.5
        assert isinstance(next(iter(Reader(p).read_metadata().storage_data)), MetadataIndex)


def test_cli_on_hostile_metadata_does_not_hang(good, tmp_path, capsys):
    from zerostall.cli.app import main
    path = _copy(good, tmp_path)
    os.unlink(os.path.join(path, ".metadata"))
    os.mkfifo(os.path.join(path, ".metadata"))
    assert main(["verify", path]) == 1
    assert "not a regular file" in capsys.readouterr().err
    assert main(["ls", path]) == 0 and "invalid" in capsys.readouterr().out
    assert main(["inspect", path]) != 0
    assert "not a regular file" in capsys.readouterr().err
