"""Kills between a commit and its retention, in consecutive runs: ``keep_last`` still bounds disk.

The failing sequence of ``test_crash_anywhere`` made deterministic: each run is a forked child
that takes the root with ``keep_last=3``, saves the next step and ``os._exit``s at the last
boundary of the commit (the ``latest`` hint, LocalTier's ``_hook`` seam), so the step is
committed and its retention never runs. Before the owner applied retention at start-up, each
such run left one more step (5 after two runs). Now the next owner prunes first: never more
than ``keep_last + 1`` steps, and an owner with ``keep_last=3`` holds exactly the newest 3.
"""

import os
import shutil

import torch

import zerostall
from zerostall.io import choose_engine
from zerostall.restore import load_step, verify_step
from zerostall.store.local import LocalTier
from tests.helpers import equal

CRASHED = 77


def state(s):
    return {"w": torch.full((3000,), float(s)), "b": torch.arange(s, s + 700, dtype=torch.int64), "step": s}


def _fork(body):
    """Run ``body()`` in a forked child; its exit code (CRASHED when a hook killed it)."""
    pid = os.fork()
    if pid == 0:
        try:
            body()
            os._exit(3)  # the crash point was never reached
        except BaseException:  # noqa: BLE001
            os._exit(4)
    _, status = os.waitpid(pid, 0)
    return os.waitstatus_to_exitcode(status)


def _save_then_die_before_retention(root, step):
    def body():
        c = zerostall.Checkpointer(root, keep_last=3, raise_on_background_error=False)

        def hook(name):
            if name == "latest":  # committed, hint written; retention would run next
                os._exit(CRASHED)

        c.tier._hook = hook
        c.save(step, state(step)).result()
    return _fork(body)


def _check(tier, steps):
    assert tier.steps() == steps
    eng = choose_engine(tier.root)
    try:
        for s in steps:
            verify_step(tier, s, eng)
        from zerostall.restore.step import shared_bounce as _shared_bounce
        assert equal(load_step(tier, steps[-1], eng, _shared_bounce(), verify=True), state(steps[-1]))
    finally:
        eng.close()


def test_kills_between_commit_and_retention_in_consecutive_runs(tmp_path):
    root = str(tmp_path / "ckpt")
    with zerostall.Checkpointer(root, keep_last=3) as c:
        for s in (1, 2, 3):
            c.save(s, state(s)).result()
    tier = LocalTier(root)
    assert _save_then_die_before_retention(root, 4) == CRASHED
    _check(tier, [1, 2, 3, 4])  # one more than keep_last: the kill fell after the commit
    for step in (5, 6, 7):
        assert _save_then_die_before_retention(root, step) == CRASHED
        # the run's owner pruned to 3 at start-up, then committed one: never two more
        _check(tier, list(range(step - 3, step + 1)))
    zerostall.Checkpointer(root).close()  # an owner without keep_last deletes nothing
    _check(tier, [4, 5, 6, 7])
    zerostall.Checkpointer(root, keep_last=3).close()  # the next owner with keep_last=3 applies it
    _check(tier, [5, 6, 7])
    assert tier.leftovers() == []


def test_crash_at_every_boundary_of_start_up_retention(tmp_path):
    base = str(tmp_path / "base")
    with zerostall.Checkpointer(base) as c:
        for s in (1, 2, 3, 4, 5):
            c.save(s, state(s)).result()
    names: list[str] = []
    rec = str(tmp_path / "record")
    shutil.copytree(base, rec)
    try:
        LocalTier._hook = names.append  # class-wide: the owner's start-up runs before tests could set it
        zerostall.Checkpointer(rec, keep_last=3).close()
    finally:
        LocalTier._hook = None
    assert LocalTier(rec).steps() == [3, 4, 5]
    assert names.count("delete_rename") == 2 and "delete_fsync" in names and "unlink" in names
    for at, name in enumerate(names):
        root = str(tmp_path / f"crash-{at}")
        shutil.copytree(base, root)

        def body(root=root, at=at):
            seen = [0]

            def hook(n):
                seen[0] += 1
                if seen[0] == at + 1:
                    os._exit(CRASHED)
            LocalTier._hook = staticmethod(hook)  # in the child only
            zerostall.Checkpointer(root, keep_last=3).close()

        assert _fork(body) == CRASHED, f"child did not crash at boundary {at} ({name})"
        tier = LocalTier(root)
        steps = tier.steps()
        assert steps[-3:] == [3, 4, 5] and set(steps) <= {1, 2, 3, 4, 5}, f"crash at {name} (#{at})"
        _check(tier, steps)
        zerostall.Checkpointer(root, keep_last=3).close()
        _check(tier, [3, 4, 5])
        assert tier.leftovers() == []
        shutil.rmtree(root)
