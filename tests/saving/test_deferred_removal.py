"""Retention's deletions off the path between two saves (docs/every-step.md).

A step that local retention dooms leaves the listing at once. The next full save writes over
its shard (unless a process holds it open); the persist thread removes the rest while that
save's first writes are in flight when it is queued behind (saving every step), before
preallocating when the disk has no room beside them, at once when nothing is queued, and at
close. Real O_DIRECT files, the LocalTier's ``_hook`` seam for the order of boundaries, the
shard opens seen through the engine.
"""

import os
import threading

import pytest
import torch

import zerostall
from zerostall.format.layout import shard_name
from zerostall.store import atomic


def _deleting(root):
    return sorted(n for n in os.listdir(root) if n.startswith(".deleting-"))


def _three_saves(root, monkeypatch, hold_open=False, grow=False):
    """keep_last=1; save 3 is queued behind save 2 (whose persist thread waits at its
    ``latest`` boundary until then). ``hold_open``: a reader keeps step 1's shard open
    throughout (and reads it at the end). Returns the events, the listing when save 2 was
    done, the listing when save 3 was done, the steps, step 1's shard inode and step 3's, and
    what the reader read (or None). ``grow``: save 3's tensor is twice the size."""
    state = {"w": torch.randn(300_000), "step": 0}
    events, gate, armed = [], threading.Event(), [False]

    def hook(name):
        events.append(name)
        if name == "latest" and armed[0]:
            armed[0] = False
            assert gate.wait(60)

    shard = shard_name(0)
    with zerostall.Checkpointer(root, keep_last=1) as ck:
        ck.save(1, state).result(timeout=60)
        ino1 = os.stat(os.path.join(root, "step-1", shard)).st_ino
        reader = os.open(os.path.join(root, "step-1", shard), os.O_RDONLY) if hold_open else None
        first = os.pread(reader, 1 << 20, 0) if hold_open else None
        ck.tier._hook = hook
        for name in ("open_write", "open_rewrite"):
            real = getattr(ck.engine, name)

            def opener(path, nbytes, real=real, name=name):
                events.append(f"{name} {os.path.basename(os.path.dirname(path))}")
                return real(path, nbytes)

            monkeypatch.setattr(ck.engine, name, opener)
        armed[0] = True
        h2 = ck.save(2, state)
        state3 = {"w": torch.randn(600_000)} if grow else state
        h3 = ck.save(3, state3)
        assert h3.wait_staged(60)  # the snapshot thread has handed it to the persist thread
        gate.set()
        h2.result(timeout=60)
        after2 = _deleting(root)
        h3.result(timeout=60)
        after3 = _deleting(root)
        steps = ck.tier.steps()
        ino3 = os.stat(os.path.join(root, "step-3", shard)).st_ino
        assert zerostall.load(root, step=3)["w"].equal(state3["w"])  # every byte verified (crc32c)
    read = None
    if reader is not None:
        read = os.pread(reader, 1 << 20, 0) == first
        os.close(reader)
    return events, after2, after3, steps, ino1, ino3, read


def test_the_next_save_writes_over_the_doomed_shard_and_removes_the_rest_while_it_writes(ckdir, monkeypatch):
    events, after2, after3, steps, ino1, ino3, _ = _three_saves(ckdir, monkeypatch)
    assert len(after2) == 1 and after2[0].startswith(".deleting-step-1-")  # out of the listing, files later
    assert [n[:17] for n in after3] == [".deleting-step-2-"]  # step 2's shard: the next save's spare
    assert steps == [3] and _deleting(ckdir) == []  # close() removed it
    assert ino3 == ino1  # step 1's shard, written over (its blocks reused), not unlinked
    i_open3 = events.index("open_rewrite step-3.partial")
    assert "open_write step-3.partial" not in events
    # moved, then opened; step 1's other files went while step 3's writes were in flight
    assert events.index("delete_fsync") < events.index("recycle") < i_open3
    assert i_open3 < events.index("unlink", i_open3) < events.index("manifest", i_open3)


def test_a_doomed_shard_a_reader_holds_open_is_never_written_over(ckdir, monkeypatch):
    events, after2, after3, steps, ino1, ino3, read = _three_saves(ckdir, monkeypatch, hold_open=True)
    assert read is True  # the reader still reads step 1's bytes
    assert ino3 != ino1 and "recycle" not in events and steps == [3] and len(after3) == 1
    i_open3 = events.index("open_write step-3.partial")
    assert i_open3 < events.index("unlink", i_open3) < events.index("manifest", i_open3)  # removed while writing


def test_a_short_disk_removes_the_doomed_step_before_preallocating(ckdir, monkeypatch):
    monkeypatch.setattr(atomic, "free_bytes", lambda path: 0)
    events, after2, after3, steps, ino1, ino3, read = _three_saves(ckdir, monkeypatch, hold_open=True)
    assert len(after2) == 1 and len(after3) == 1 and steps == [3] and read is True
    i_open3 = events.index("open_write step-3.partial")
    assert events.index("unlink") < i_open3  # room first: deferring never costs an ENOSPC


def test_a_short_disk_removes_the_doomed_step_before_growing_the_shard_it_writes_over(ckdir, monkeypatch):
    monkeypatch.setattr(atomic, "free_bytes", lambda path: 0)
    events, after2, after3, steps, ino1, ino3, _ = _three_saves(ckdir, monkeypatch, grow=True)
    assert ino3 == ino1 and steps == [3]  # written over, and longer now
    i_open3 = events.index("open_rewrite step-3.partial")
    assert events.index("recycle") < events.index("unlink") < i_open3  # room first, as for a new file


@pytest.mark.parametrize("spare", [True, False])
def test_a_lone_save_keeps_only_a_spare_shard_which_the_next_save_writes_over(ckdir, spare):
    state = {"w": torch.randn(1000)}
    shard = shard_name(0)
    events = []
    with zerostall.Checkpointer(ckdir, keep_last=2, spare_shard=spare) as ck:
        ck.tier._hook = events.append
        for s in (1, 2, 3, 4):
            rec = ck.save(s, state).result(timeout=60)
            assert rec.post_commit_s > 0  # the persist thread's time after durable: hint, retention, removal
            left = _deleting(ckdir)
            if s < 3 or not spare:  # nothing doomed yet, or removed before the save is done
                assert left == []
            else:  # nothing queued behind: all removed but the doomed shard, out of the listing
                assert len(left) == 1 and left[0].startswith(f".deleting-step-{s - 2}-")
                assert os.listdir(os.path.join(ckdir, left[0])) == [shard]
        assert ck.tier.steps() == [3, 4]
        assert events.count("recycle") == (1 if spare else 0)  # step 4 wrote over step 1's shard
    assert _deleting(ckdir) == []  # close() removed the spare
    assert zerostall.load(ckdir)["w"].equal(state["w"])


def test_deferred_removals_run_at_exit_and_a_failure_is_only_logged(tmp_path, caplog):
    root = str(tmp_path)
    for n in ("a", "b"):
        os.makedirs(os.path.join(root, f".deleting-step-{n}", "sub"))
        open(os.path.join(root, f".deleting-step-{n}", "sub", "f"), "wb").close()
    seen = []
    d = atomic.DeferredRemovals(root, seen.append)
    d.add(os.path.join(root, ".deleting-step-a"))
    d.add(os.path.join(root, ".deleting-step-b"))
    d.run_if_short(0)  # room enough: nothing yet
    assert len(os.listdir(root)) == 2 and d
    orig = atomic.rmtree

    def failing(path, hook=None):
        if path.endswith("-a"):
            raise PermissionError(13, "denied", path)
        orig(path, hook)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(atomic, "rmtree", failing)
        d.run()
    assert os.listdir(root) == [".deleting-step-a"] and not d  # the other one went; a is left to recovery
    assert "could not remove" in caplog.text and seen.count("unlink") == 3


def test_a_doomed_shard_hard_linked_elsewhere_is_never_written_over(ckdir, tmp_path):
    """A user's ``cp -al`` / ``rsync --link-dest`` backup of a step (or zerostall's own links)
    shares the shard's inode: writing over it would overwrite the backup too."""
    shard = shard_name(0)
    backup = str(tmp_path / "backup-step-1")
    with zerostall.Checkpointer(ckdir, keep_last=1) as ck:
        events = []
        ck.save(1, {"w": torch.ones(300_000)}).result(timeout=60)
        before = open(os.path.join(ckdir, "step-1", shard), "rb").read()
        os.link(os.path.join(ckdir, "step-1", shard), backup)
        assert atomic.unshared(backup) is False  # no process has it open, but another name has it
        ck.tier._hook = events.append
        for s in (2, 3):
            ck.save(s, {"w": torch.full((300_000,), float(s))}).result(timeout=60)
        assert "recycle" not in events
    assert open(backup, "rb").read() == before


@pytest.mark.parametrize("fs", ["ceph", "fuse.juicefs"])
def test_a_doomed_shard_on_a_filesystem_other_nodes_share_is_never_written_over(ckdir, monkeypatch, fs):
    """A write lease sees only this kernel's opens: on a filesystem other nodes mount, a
    reader there (an evaluator loading the step) is invisible to it, and unlink keeps an
    opened file readable where writing over it would not."""
    monkeypatch.setattr(atomic, "fs_of", lambda path: (fs, "/"))
    events = []
    with zerostall.Checkpointer(ckdir, keep_last=1) as ck:
        ck.save(1, {"w": torch.ones(1000)}).result(timeout=60)
        ck.tier._hook = events.append
        for s in (2, 3):
            ck.save(s, {"w": torch.full((1000,), float(s))}).result(timeout=60)
        assert "recycle" not in events and _deleting(ckdir) == []  # no spare kept either
    assert zerostall.load(ckdir)["w"].equal(torch.full((1000,), 3.0))


def test_a_doomed_shard_that_cannot_be_written_over_gives_way_to_a_new_file(ckdir, monkeypatch):
    """The shard taken may refuse the rewrite (a user made the old step read-only, a growth
    the disk has no room for): the save writes a new file instead of failing."""
    from zerostall.errors import storage_error
    events = []
    with zerostall.Checkpointer(ckdir, keep_last=1) as ck:
        ck.save(1, {"w": torch.ones(1000)}).result(timeout=60)
        ck.tier._hook = events.append

        def refuse(path, nbytes):
            events.append("open_rewrite")
            raise storage_error("opening", path, PermissionError(13, "Permission denied", path))
        monkeypatch.setattr(ck.engine, "open_rewrite", refuse)
        for s in (2, 3):
            ck.save(s, {"w": torch.full((1000,), float(s))}).result(timeout=60)
        assert "recycle" in events and "open_rewrite" in events and ck.tier.steps() == [3]
    assert zerostall.load(ckdir)["w"].equal(torch.full((1000,), 3.0)) and _deleting(ckdir) == []
