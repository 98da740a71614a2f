"""A new owner's start-up cleanup never removes the ``.partial`` that another process's
``load(remote=)`` is downloading into (it used to: the restore then failed or fell back to an
older step). The download holds its step's lock (``StepLock``); cleanup skips a locked step,
and removes what an interrupted download left (its ``.partial`` and lock file).

Real processes, real files: the restoring child pauses inside its download (the seam: the
shared-filesystem tier's ``download``) until the parent's owner has started up."""

import os
import subprocess
import sys
import textwrap
import time

import pytest
import torch

import zerostall
from zerostall.store.local import LocalTier

pytestmark = pytest.mark.timeout(180)

CHILD = textwrap.dedent("""
    import os, sys, time
    from zerostall.store.sharedfs import FileTier
    root, url, started, go = sys.argv[1:5]
    orig = FileTier.download

    def paused(self, rel, local_path, size):
        orig(self, rel, local_path, size)  # the first file is in the .partial: now wait
        open(started, "w").close()
        deadline = time.monotonic() + 120
        while not os.path.exists(go) and time.monotonic() < deadline:
            time.sleep(0.02)

    FileTier.download = paused
    import zerostall
    from zerostall import LoadReport
    rep = LoadReport()
    got = zerostall.load(root, remote=url, report=rep)
    print(rep.step, rep.source, got["a"][0].item(), len(rep.failed))
""")


def _wait_for(path, proc):
    deadline = time.monotonic() + 120
    while not os.path.exists(path):
        assert proc.poll() is None, proc.communicate()
        assert time.monotonic() < deadline, "the child never started its download"
        time.sleep(0.02)


def test_owner_cleanup_skips_a_download_in_flight(tmp_path):
    remote = str(tmp_path / "remote")
    url = f"file://{remote}"
    with zerostall.Checkpointer(str(tmp_path / "train"), remote=url) as ck:
        ck.save(3, {"a": torch.full((5000,), 3.0)}).wait(tier="remote", timeout=120)
    root = str(tmp_path / "node")
    started, go = str(tmp_path / "started"), str(tmp_path / "go")
    child = subprocess.Popen([sys.executable, "-c", CHILD, root, url, started, go], stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, text=True)
    try:
        _wait_for(started, child)
        assert os.path.isdir(os.path.join(root, "step-3.partial"))
        owner = LocalTier(root)
        done = owner.own()  # a training run starts on this root while the restore downloads
        try:
            assert os.path.isdir(os.path.join(root, "step-3.partial")), done
            assert any("kept the leftovers of step 3" in line and str(child.pid) in line for line in done), done
        finally:
            owner.release()
        open(go, "w").close()
        out, err = child.communicate(timeout=120)
    finally:
        if child.poll() is None:
            child.kill()
            child.wait()
    assert child.returncode == 0, err
    assert out.split() == ["3", "remote", "3.0", "0"], (out, err)
    assert sorted(os.listdir(root)) == [".zerostall.fetch.lock", ".zerostall.lock", "latest", "step-3"]


def test_cleanup_removes_what_an_interrupted_download_left(tmp_path):
    root = str(tmp_path / "node")
    zerostall.save(root, {"a": torch.ones(10)}, step=1)
    os.mkdir(os.path.join(root, "step-2.partial"))
    open(os.path.join(root, "step-2.partial", "rank-0.shard"), "wb").close()
    open(os.path.join(root, ".zerostall-fetch-step-2.lock"), "wb").close()  # its holder died
    open(os.path.join(root, ".zerostall-fetch-step-7.lock"), "wb").close()
    from zerostall.store.owner import StepLock
    held = StepLock(root, 9)
    assert held.acquire(wait=False)  # a live download of step 9 (no leftovers yet)
    try:
        owner = LocalTier(root)
        owner.own()
        owner.release()
        assert sorted(os.listdir(root)) == [".zerostall-fetch-step-9.lock", ".zerostall.lock", "latest", "step-1"]
    finally:
        held.release()
    assert not os.path.exists(os.path.join(root, ".zerostall-fetch-step-9.lock"))


def test_odd_entries_under_a_fetch_lock_name_do_not_stop_the_owner(tmp_path):
    """A directory, a FIFO and a dangling symlink named like a restore's step lock: no process
    can hold them (StepLock takes regular files only), so the owner's start-up cleanup removes
    them; it failed with 'recovering leftovers ... failed: Is a directory' (the root could not
    be opened for writing at all)."""
    root = tmp_path / "r"
    zerostall.save(str(root), {"a": torch.ones(3)}, step=1)
    os.mkdir(root / ".zerostall-fetch-step-1.lock")
    os.mkfifo(root / ".zerostall-fetch-step-2.lock")
    os.symlink(tmp_path / "nowhere", root / ".zerostall-fetch-step-3.lock")
    with zerostall.Checkpointer(str(root)) as ck:
        ck.save(4, {"a": torch.ones(3)}).wait()
    assert not [n for n in os.listdir(root) if n.startswith(".zerostall-fetch-")]
    assert zerostall.load(str(root))["a"].sum().item() == 3
