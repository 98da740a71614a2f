"""One writer per root: a second writer is refused, and a removed lock file is handled.

Two processes on one root: the second writer is refused, 50 times, each time while the
owner has a save in flight; the in-flight saves are not disturbed and readers see only
committed steps."""

import os
import subprocess
import sys

import pytest
import torch

import zerostall
from zerostall.errors import RootLockedError
from zerostall.errors import RootLockedError, ZerostallError
from zerostall.store.local import LocalTier

N = 50
WORKER = os.path.join(os.path.dirname(__file__), "owner_worker.py")


@pytest.mark.timeout(300)
def test_second_writer_refused_fifty_times_during_saves(ckdir):
    os.makedirs(ckdir)
    a = subprocess.Popen([sys.executable, WORKER, ckdir, str(N)], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                         text=True)
    try:
        tag, pid = a.stdout.readline().split()
        assert tag == "ready" and int(pid) == a.pid
        refused = 0
        for i in range(N):
            assert a.stdout.readline().split() == ["inflight", str(i)]
            part = os.path.join(ckdir, f"step-{i}.partial")
            before = sorted(os.listdir(part))
            assert before == ["manifest.json", "rank-00000.shard"]
            with pytest.raises(RootLockedError) as ei:
                zerostall.Checkpointer(ckdir, lock_timeout_s=0.05 if i % 10 == 0 else 0.0)
            assert f"pid {a.pid} on host" in str(ei.value) and ei.value.owner["pid"] == a.pid
            refused += 1
            assert sorted(os.listdir(part)) == before  # the refused writer cleaned nothing
            if i:  # a reader (no lock) meanwhile sees the newest committed step, whole
                got = zerostall.load(ckdir)
                assert got["i"] == i - 1 and torch.equal(got["w"], torch.full((5000,), float(i - 1)))
            a.stdin.write("go\n")
            a.stdin.flush()
            assert a.stdout.readline().split() == ["durable", str(i), "True"]
        assert a.stdout.readline().strip() == "closed"
        assert a.wait(60) == 0
    finally:
        if a.poll() is None:
            a.kill()
            a.wait()
    assert refused == N
    tier = LocalTier(ckdir)
    assert tier.steps() == list(range(N)) and tier.leftovers() == []
    for s in range(N):
        got = zerostall.load(ckdir, step=s)
        assert got["i"] == s and torch.equal(got["w"], torch.full((5000,), float(s)))
    with zerostall.Checkpointer(ckdir) as c:  # the owner is gone: the root is free again
        c.save(N, {"w": torch.zeros(1), "i": N}).result()


@pytest.mark.timeout(60)
def test_fifo_planted_as_the_lock_file_is_refused_not_hung(tmp_path):
    """A FIFO named .zerostall.lock: the writer refuses it clearly (before, the first writer
    opened it read-write and a second writer then blocked forever reading the owner's name)."""
    from zerostall.errors import StorageError
    from zerostall.store.owner import read_owner
    root = str(tmp_path / "ck")
    os.makedirs(root)
    os.mkfifo(os.path.join(root, ".zerostall.lock"))
    fd = os.open(os.path.join(root, ".zerostall.lock"), os.O_RDWR)  # a writer end held open
    try:
        assert read_owner(root) == {}
        with pytest.raises(StorageError, match="not a regular file"):
            zerostall.Checkpointer(root)
    finally:
        os.close(fd)


# The root lock file removed by a third party while its writer is open.
#
# Found by adv2: after ``rm ROOT/.zerostall.lock`` (a user "clearing a stale lock" after a
# RootLockedError, a tmp cleaner removing dotfiles), a second Checkpointer opens the root as
# its owner (it locks a new file of that name) while the first keeps saving: two writers, each
# of which cleans the other's ``.partial`` directories at start and applies retention to the
# other's steps.

def test_second_writer_refused_after_the_lock_file_was_removed(ckdir):
    a = zerostall.Checkpointer(ckdir, lock_timeout_s=0)
    try:
        a.save(1, {"x": torch.ones(2)}).result()
        os.unlink(os.path.join(ckdir, ".zerostall.lock"))
        with pytest.raises(RootLockedError):
            b = zerostall.Checkpointer(ckdir, lock_timeout_s=0)
            b.close()
    finally:
        try:
            a.close()
        except ZerostallError:
            pass
    with zerostall.Checkpointer(ckdir, lock_timeout_s=0) as c:  # once the first closed, the root is free
        assert c.steps() == [1]
