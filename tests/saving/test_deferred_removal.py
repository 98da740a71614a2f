"""Retention's deletions off the path between two saves (docs/every-step.md).

A step that local retention dooms leaves the listing at once; its files are removed by the
persist thread while the next save's first writes are in flight when a save is queued
behind (saving every step), before preallocating when the disk has no room beside them, at
once when nothing is queued, and at close. Real O_DIRECT files, the LocalTier's ``_hook``
seam for the order of boundaries, the shard opens seen through the engine.
"""

import os
import threading

import pytest
import torch

import zerostall
from zerostall.store import atomic


def _deleting(root):
    return sorted(n for n in os.listdir(root) if n.startswith(".deleting-"))


def _three_saves(root, monkeypatch):
    """keep_last=1; save 3 is queued behind save 2 (whose persist thread waits at its
    ``latest`` boundary until then). Returns the events, the listing when save 2 was done
    and the listing when save 3 was done."""
    state = {"w": torch.randn(300_000), "step": 0}
    events, gate, armed = [], threading.Event(), [False]

    def hook(name):
        events.append(name)
        if name == "latest" and armed[0]:
            armed[0] = False
            assert gate.wait(60)

    with zerostall.Checkpointer(root, keep_last=1) as ck:
        ck.save(1, state).result(timeout=60)
        ck.tier._hook = hook
        real_open = ck.engine.open_write

        def open_write(path, nbytes):
            events.append(f"open {os.path.basename(os.path.dirname(path))}")
            return real_open(path, nbytes)

        monkeypatch.setattr(ck.engine, "open_write", open_write)
        armed[0] = True
        h2 = ck.save(2, state)
        h3 = ck.save(3, state)
        assert h3.wait_staged(60)  # the snapshot thread has handed it to the persist thread
        gate.set()
        h2.result(timeout=60)
        after2 = _deleting(root)
        h3.result(timeout=60)
        after3 = _deleting(root)
        steps = ck.tier.steps()
    return events, after2, after3, steps


def test_a_doomed_step_is_removed_while_the_next_save_writes(ckdir, monkeypatch):
    events, after2, after3, steps = _three_saves(ckdir, monkeypatch)
    assert len(after2) == 1 and after2[0].startswith(".deleting-step-1-")  # out of the listing, files later
    assert after3 == [] and steps == [3] and _deleting(ckdir) == []
    i_open3 = events.index("open step-3.partial")
    first_unlink = events.index("unlink")
    # step 1's files went after step 3's shard was opened: while its writes were in flight
    assert events.index("delete_fsync") < i_open3 < first_unlink < events.index("manifest", i_open3)


def test_a_short_disk_removes_the_doomed_step_before_preallocating(ckdir, monkeypatch):
    monkeypatch.setattr(atomic, "free_bytes", lambda path: 0)
    events, after2, after3, steps = _three_saves(ckdir, monkeypatch)
    assert len(after2) == 1 and after3 == [] and steps == [3]
    i_open3 = events.index("open step-3.partial")
    assert events.index("unlink") < i_open3  # room first: deferring never costs an ENOSPC


def test_a_lone_save_ends_with_its_doomed_step_gone(ckdir):
    state = {"w": torch.randn(1000)}
    with zerostall.Checkpointer(ckdir, keep_last=2) as ck:
        for s in (1, 2, 3):
            ck.save(s, state).result(timeout=60)
            assert _deleting(ckdir) == []  # nothing queued behind: removed before the save is done
        assert ck.tier.steps() == [2, 3]


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
