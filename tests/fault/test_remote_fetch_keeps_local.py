"""A failed download of a step from the remote tier never removes the local copy of that step.

``load(path, remote=...)`` tries each step's local copy, then its remote copy. When the remote
copy cannot even be fetched (here: its shard is truncated on a ``file://`` tier), nothing was
downloaded, so the local ``step-N`` (damaged or not: the evidence, and possibly mostly good
bytes) must stay where it was.
"""

import os

import pytest
import torch

import zerostall
from zerostall import LoadReport


@pytest.mark.timeout(120)
def test_failed_remote_fetch_keeps_the_local_step(tmp_path):
    local, rem = str(tmp_path / "local"), str(tmp_path / "remote")
    url = f"file://{rem}"
    with zerostall.Checkpointer(local, remote=url) as ck:
        ck.save(1, {"a": torch.arange(1000.)})
        ck.save(2, {"a": torch.arange(1000.) * 2})
    assert os.path.exists(os.path.join(rem, "step-2", "manifest.json"))
    shard = os.path.join(local, "step-2", "rank-00000.shard")
    with open(shard, "r+b") as f:  # one bit of tensor data flipped in the local copy
        f.seek(4096 + 8)
        b = f.read(1)
        f.seek(4096 + 8)
        f.write(bytes([b[0] ^ 1]))
    before = sorted(os.listdir(os.path.join(local, "step-2")))
    os.truncate(os.path.join(rem, "step-2", "rank-00000.shard"), 100)  # the remote copy cannot be fetched

    report = LoadReport()
    got = zerostall.load(local, remote=url, report=report)
    assert report.step == 1 and got["a"][1].item() == 1.0
    assert len(report.failed) == 2  # step 2 local, then step 2 remote
    assert "100 bytes, the manifest says" in report.failed[1]  # named, not a raw I/O error
    assert sorted(os.listdir(os.path.join(local, "step-2"))) == before
