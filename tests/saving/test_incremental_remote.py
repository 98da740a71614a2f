"""Incremental saves on a remote tier: each file is uploaded once (with the step that wrote
it), remote retention keeps referenced steps, a remote restore fetches what a step borrows."""

import os
import shutil
import uuid

import pytest
import torch

import zerostall
from zerostall.cli import main as cli
from zerostall.store.tier import open_tier

pytestmark = pytest.mark.timeout(300)


@pytest.fixture(params=["file", "s3"])
def remote_url(request, tmp_path):
    if request.param == "s3":
        if os.environ.get("ZEROSTALL_TEST_S3") != "1":
            if os.environ.get("CI"):
                pytest.fail("CI must start the S3 server (scripts/s3-server.sh start) before the tests")
            pytest.skip("no S3 server: run scripts/s3-server.sh start and export its environment")
        return f"s3://incremental-test/{uuid.uuid4().hex[:12]}"
    return f"file://{tmp_path / 'remote'}"


def _state(step, frozen):
    return {"frozen": frozen, "head": torch.full((1000,), float(step)), "step": step}


def test_incremental_replicates_once_and_restores_from_remote(remote_url, tmp_path):
    local = str(tmp_path / "local")
    frozen = torch.randn(1 << 18)  # 1 MiB, written once
    with zerostall.Checkpointer(local, remote=remote_url, incremental=True, full_every=None,
                                keep_last=1, keep_last_remote=1) as ck:
        hs = []
        for s in range(4):  # one at a time: a save references the last *committed* step
            hs.append(ck.save(s, _state(s, frozen)))
            hs[-1].result()
        assert hs[-1].wait(timeout=120, tier="remote")  # (1 and 2 are not wanted remotely)
        assert [h.result().bytes_referenced for h in hs] == [0] + [frozen.numel() * 4] * 3
    remote = open_tier(remote_url)
    assert remote.steps() == [0, 3]  # 3 borrows from 0: remote retention keeps 0
    m3 = remote.read_manifest(3)
    assert {r.step for r in m3.ref_files} == {0} and m3.total_bytes < frozen.numel() * 4 // 10
    assert [n for n in sorted(os.listdir(local)) if n.startswith("step-")] == ["step-0", "step-3"]
    shutil.rmtree(local)
    got = zerostall.load(local, remote=remote_url)  # fetches 3, and 0 for what 3 borrows
    assert torch.equal(got["frozen"], frozen) and got["step"] == 3
    other = str(tmp_path / "other")
    assert cli(["restore", remote_url, "--to", other]) == 0
    assert zerostall.load(other)["step"] == 3
    assert cli(["verify", remote_url]) == 0


def test_a_damaged_local_base_is_fetched_again_from_the_remote(tmp_path):
    """Step 2 (only on the remote now) borrows from step 0, whose local file is damaged: load
    fetches step 0 again from the remote and returns step 2, not a fallback to step 0."""
    local, url = str(tmp_path / "local"), f"file://{tmp_path / 'remote'}"
    frozen = torch.randn(1 << 12)
    with zerostall.Checkpointer(local, incremental=True, remote=url, keep_last=10) as ck:
        for step in range(3):
            ck.save(step, _state(step, frozen)).result()
        ck.wait()
    shutil.rmtree(os.path.join(local, "step-2"))
    shard = [n for n in os.listdir(os.path.join(local, "step-0")) if n != "manifest.json"][0]
    with open(os.path.join(local, "step-0", shard), "r+b") as f:
        f.seek(4096 + 10)
        byte = f.read(1)
        f.seek(4096 + 10)
        f.write(bytes([byte[0] ^ 1]))
    got = zerostall.load(local, remote=url)
    assert got["step"] == 2 and torch.equal(got["frozen"], frozen)
    assert zerostall.load(local, step=0, fallback=False)["step"] == 0  # the local copy is whole again
