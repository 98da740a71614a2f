"""A DCP ``.metadata`` whose pickle shares objects cannot make validation quadratic (issue 23):
the work done is bounded by the records the file holds, and the file is refused."""

import dataclasses
import os
import pickle

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex, TensorStorageMetadata

from zerostall.dcp import Reader, Writer
from zerostall.integrations import dcp_meta
from zerostall.errors import CorruptCheckpoint

pytestmark = [pytest.mark.timeout(120), pytest.mark.filterwarnings("ignore::UserWarning")]

N = M = 300  # entries, and chunks in the one list they all share


def _shared_metadata(path, repeat_chunk=True):
    dcp.save({"w": torch.arange(40, dtype=torch.float32)}, storage_writer=Writer(path), no_dist=True)
    with open(os.path.join(path, ".metadata"), "rb") as f:
        md = pickle.load(f)  # the test's own file
    w_key = next(k for k in md.storage_data if k.fqn == "w")
    rec = dataclasses.replace(md.storage_data[w_key], nbytes=4, shape=(1,))
    props = md.state_dict_metadata["w"].properties
    if repeat_chunk:  # one chunk object, M times: a few bytes per copy in the pickle
        chunks = [ChunkStorageMetadata(offsets=torch.Size([0]), sizes=torch.Size([1]))] * M
    else:  # M distinct offsets, one list shared by every entry
        chunks = [ChunkStorageMetadata(offsets=torch.Size([i]), sizes=torch.Size([1])) for i in range(M)]
    entry = TensorStorageMetadata(properties=props, size=torch.Size([M]), chunks=chunks)
    for i in range(N):
        md.state_dict_metadata[f"x{i}"] = entry  # shared by every entry (pickle's memo)
        md.storage_data[MetadataIndex(f"x{i}", torch.Size([0]))] = rec
    raw = pickle.dumps(md)
    with open(os.path.join(path, ".metadata"), "wb") as f:
        f.write(raw)
    return len(raw)


@pytest.mark.parametrize("repeat_chunk", [True, False])
def test_shared_objects_do_not_multiply_the_work(tmp_path, monkeypatch, repeat_chunk):
    path = str(tmp_path / "ck")
    size = _shared_metadata(path, repeat_chunk)
    calls = []
    real = dcp_meta._shape
    monkeypatch.setattr(dcp_meta, "_shape", lambda *a: calls.append(1) or real(*a))
    with pytest.raises(CorruptCheckpoint) as ei:
        Reader(path).read_metadata()
    msg = str(ei.value)
    assert ".metadata" in msg and "chunk" in msg, msg
    # linear: about one shape per record and per distinct chunk walked, never N * M (= 90000)
    assert len(calls) <= 4 * (N + M) + 100, f"{len(calls)} shapes checked for a {size}-byte file"


def test_records_bounded(tmp_path, monkeypatch):
    path = str(tmp_path / "ck")
    dcp.save({"w": torch.ones(4)}, storage_writer=Writer(path), no_dist=True)
    monkeypatch.setattr(dcp_meta, "MAX_RECORDS", 0)
    with pytest.raises(CorruptCheckpoint, match="storage records, over the limit"):
        Reader(path).read_metadata()
