"""A step the remote already holds under another checkpoint is uploaded again, never taken
for replicated.

A run that restarts from an earlier step (say the remote's step 2 failed to load, so training
resumed from step 1 and saves step 2 again), or a new local root on a remote an earlier run
used, saves a step number the remote lists with other bytes. Counting that step as
replicated would mark the save's handle replicated, and local retention would then delete
the only copy of the new bytes.
"""

import os

import pytest
import torch

import zerostall
from zerostall import LoadReport


@pytest.mark.timeout(180)
def test_step_saved_again_replaces_the_remote_copy(tmp_path):
    url = f"file://{tmp_path / 'remote'}"
    with zerostall.Checkpointer(str(tmp_path / "run1"), remote=url) as ck:
        ck.save(1, {"a": torch.full((100,), 1.0)})
        ck.save(2, {"a": torch.full((100,), 2.0)})  # the old run's step 2
    with zerostall.Checkpointer(str(tmp_path / "run2"), remote=url, keep_last=1) as ck:
        ck.save(2, {"a": torch.full((100,), 20.0)})  # the new run's step 2
        h = ck.save(3, {"a": torch.full((100,), 30.0)})
        h.wait(tier="remote", timeout=120)
    # keep_last=1 removed run2's local step 2: the remote must hold the new bytes
    assert not os.path.exists(tmp_path / "run2" / "step-2")
    got = zerostall.load(str(tmp_path / "fresh"), remote=url, step=2)
    assert torch.equal(got["a"], torch.full((100,), 20.0))


@pytest.mark.timeout(180)
def test_stale_remote_step_that_others_borrow_from_is_kept(tmp_path):
    """If remote steps borrow bytes from the stale copy (incremental saves of the earlier run),
    replacing it would break them: both copies stay, and the local step is not counted as
    replicated (so local retention keeps it)."""
    url = f"file://{tmp_path / 'remote'}"
    frozen = torch.randn(1 << 16)
    with zerostall.Checkpointer(str(tmp_path / "run1"), remote=url, incremental=True, full_every=None) as ck:
        ck.save(1, {"frozen": frozen, "head": torch.full((100,), 1.0)}).result()
        h = ck.save(2, {"frozen": frozen, "head": torch.full((100,), 2.0)})
        assert h.result().bytes_referenced > 0  # remote step 2 will borrow from step 1
    with zerostall.Checkpointer(str(tmp_path / "run2"), remote=url, keep_last=1) as ck:
        ck.save(1, {"frozen": frozen * 0, "head": torch.full((100,), 10.0)}).result()
        h = ck.save(3, {"frozen": frozen * 0, "head": torch.full((100,), 30.0)})
        h.wait(tier="remote", timeout=120)
    got = zerostall.load(str(tmp_path / "fresh"), remote=url, step=2)  # the earlier run's step 2 still loads
    assert torch.equal(got["frozen"], frozen) and torch.equal(got["head"], torch.full((100,), 2.0))
    kept = zerostall.load(str(tmp_path / "run2"), step=1)  # the new step 1 is kept locally
    assert torch.equal(kept["head"], torch.full((100,), 10.0))


# ---- remote_fetch_keeps_local: A failed download of a step from the remote tier never removes the local copy of that step.
#
# ``load(path, remote=...)`` tries each step's local copy, then its remote copy. When the remote
# copy cannot even be fetched (here: its shard is truncated on a ``file://`` tier), nothing was
# downloaded, so the local ``step-N`` (damaged or not: the evidence, and possibly mostly good
# bytes) must stay where it was.


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
