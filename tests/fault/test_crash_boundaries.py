"""A crash at every boundary of commit, overwrite and retention (each rename/unlink/fsync).

For each scenario the sequence of boundaries is recorded once (LocalTier's ``_hook`` seam),
then for every position in it a forked child runs the same save and ``os._exit``s right
after that boundary. The parent then checks the files as a reader finds them, lets the next
owner recover the root, and checks again: the newest committed step loads bit-exact, no
committed step is torn, and no leftover remains.
"""

import os
import shutil

import pytest
import torch

import zerostall
from zerostall.restore import load_step, verify_step
from zerostall.io import choose_engine
from zerostall.store.local import LocalTier
from tests.helpers import equal

CRASHED = 77
STATES = {s: {"w": torch.full((3000,), float(s)), "b": torch.arange(s, s + 700, dtype=torch.int64),
              "step": s} for s in (1, 2, 3)}
NEW = {"w": torch.full((3000,), -5.0), "b": torch.arange(700, dtype=torch.int64) * 7, "step": 2}

# scenario: (keep_last, step saved by the crashing child, overwrite, its content)
SCENARIOS = {
    "overwrite": (None, 2, True, NEW),
    "retention": (2, 3, False, STATES[3]),
}


def _baseline(root):
    with zerostall.Checkpointer(root) as c:
        for s in (1, 2):
            c.save(s, STATES[s]).result()


def _run(root, scenario, exchange, hook):
    keep, step, overwrite, state = SCENARIOS[scenario]
    LocalTier.exchange = exchange
    with zerostall.Checkpointer(root, keep_last=keep, raise_on_background_error=False) as c:
        c.tier._hook = hook
        c.save(step, state, overwrite=overwrite).result()
        c.tier._hook = None


def _crash_child(root, scenario, exchange, at):
    """Fork; the child crashes after boundary number ``at``. Returns the child's exit code."""
    pid = os.fork()
    if pid == 0:
        try:
            seen = [0]

            def hook(name):
                seen[0] += 1
                if seen[0] == at + 1:
                    os._exit(CRASHED)

            _run(root, scenario, exchange, hook)
            os._exit(3)  # the boundary was never reached
        except BaseException:  # noqa: BLE001
            os._exit(4)
    _, status = os.waitpid(pid, 0)
    return os.waitstatus_to_exitcode(status)


def _content(tier, step):
    eng = choose_engine(tier.root)
    try:
        return load_step(tier, step, eng, _bounce(), verify=True)
    finally:
        eng.close()


def _bounce():
    from zerostall.restore.step import shared_bounce as _shared_bounce
    return _shared_bounce()


def _check_no_torn_step(tier):
    eng = choose_engine(tier.root)
    try:
        assert tier.listed_steps() == tier.steps(), "a step directory without a valid manifest"
        for s in tier.steps():
            verify_step(tier, s, eng)  # every committed step verifies, every byte
    finally:
        eng.close()


@pytest.mark.parametrize("scenario, exchange", [("overwrite", True), ("overwrite", False), ("retention", True)],
                         ids=["overwrite-exchange", "overwrite-two-phase", "retention"])
def test_crash_at_every_boundary(tmp_path, scenario, exchange):
    base = str(tmp_path / "base")
    _baseline(base)
    # record the boundaries of one uninterrupted run
    names: list[str] = []
    rec = str(tmp_path / "record")
    shutil.copytree(base, rec)
    try:
        _run(rec, scenario, exchange, names.append)
    finally:
        LocalTier.exchange = True
    commit_point = names.index("exchange" if exchange and scenario == "overwrite" else "rename")
    if scenario == "overwrite":
        assert ("exchange" in names) == exchange and ("rename_old" in names) != exchange
    else:
        assert "delete_rename" in names and "delete_fsync" in names
    assert "unlink" in names and "fsync_root" in names and "latest" in names
    _, step, _, state = SCENARIOS[scenario]
    for at, name in enumerate(names):
        root = str(tmp_path / f"crash-{at}")
        shutil.copytree(base, root)
        code = _crash_child(root, scenario, exchange, at)
        assert code == CRASHED, f"child did not crash at boundary {at} ({name}): exit {code}"
        committed = at >= commit_point
        tier = LocalTier(root)
        # as a reader finds the root, before anyone recovers it
        if scenario == "retention":
            assert 2 in tier.steps() and tier.latest() == (3 if committed else 2), f"crash at {name} (#{at})"
            assert equal(_content(tier, tier.latest()), state if committed else STATES[2])
        elif not exchange and name == "rename_old":  # the two-phase window: recovery restores step 2
            assert tier.steps() == [1] and equal(_content(tier, 1), STATES[1])
        else:
            assert tier.latest() == 2, f"step 2 absent after a crash at {name} (#{at})"
            assert equal(_content(tier, 2), NEW if committed else STATES[2]), f"crash at {name} (#{at})"
        # the next owner recovers and cleans
        with zerostall.Checkpointer(root) as c:
            assert c.tier.leftovers() == [], f"leftovers after recovery (crash at {name} #{at})"
        assert sorted(os.listdir(root)) == sorted(
            [f"step-{s}" for s in tier.steps()] + [".zerostall.lock"] + (["latest"] if "latest" in os.listdir(root)
                                                                         else []))
        _check_no_torn_step(tier)
        if scenario == "overwrite":
            assert tier.steps() == [1, 2]
            assert equal(_content(tier, 2), NEW if committed else STATES[2]), f"crash at {name} (#{at})"
        else:
            assert 2 in tier.steps() and tier.latest() == (3 if committed else 2)
            assert equal(_content(tier, tier.latest()), state if committed else STATES[2])
            assert set(tier.steps()) <= {1, 2, 3}
        shutil.rmtree(root)
