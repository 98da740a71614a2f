"""Retention, local and remote: what it keeps, and what is never uploaded because it would not be kept.

Retention that cannot delete what it just saved, and failures after the commit point."""

import errno
import os

import pytest
import torch

import zerostall
from zerostall.errors import SaveFailed, StepOrderError
from zerostall.store.local import LocalTier


def st(i):
    return {"w": torch.full((2000,), float(i)), "i": i}


def _durable_then_present(c, step, **kw):
    h = c.save(step, st(step), **kw)
    rec = h.result()
    assert rec.ok and h.durable()
    assert step in c.tier.steps(), f"step {step} reported durable and was deleted"
    assert zerostall.load(c.tier.root, step=step)["i"] == step
    return rec


@pytest.mark.parametrize("damage", ["garbage", "no-shard", "empty-dir", "bad-crc"])
def test_damaged_higher_step_is_neither_counted_nor_deleted(ckdir, damage):
    zerostall.save(ckdir, st(5), step=5)
    bad = os.path.join(ckdir, "step-1000")
    os.mkdir(bad)
    man = os.path.join(bad, "manifest.json")
    if damage == "garbage":
        open(man, "w").write("{not json")
    elif damage == "bad-crc":
        raw = open(os.path.join(ckdir, "step-5", "manifest.json")).read().replace('"step": 5', '"step": 1000')
        open(man, "w").write(raw)  # the body crc no longer matches
    elif damage == "no-shard":
        open(os.path.join(bad, "rank-00000.shard"), "wb").write(b"x")
    with zerostall.Checkpointer(ckdir, keep_last=1) as c:
        for s in (10, 20, 30):
            _durable_then_present(c, s)
        assert c.tier.steps() == [30]
    assert os.path.isdir(bad) and LocalTier(ckdir).latest() == 30
    assert zerostall.load(ckdir)["i"] == 30


def test_keep_last_two_counts_only_loadable_steps(ckdir):
    os.makedirs(os.path.join(ckdir, "step-900"))  # not a checkpoint: no manifest
    os.makedirs(os.path.join(ckdir, "notes"))
    with zerostall.Checkpointer(ckdir, keep_last=2) as c:
        for s in (1, 2, 3):
            _durable_then_present(c, s)
        assert c.tier.steps() == [2, 3]
    assert os.path.isdir(os.path.join(ckdir, "step-900")) and os.path.isdir(os.path.join(ckdir, "notes"))


def test_older_runs_higher_steps_refuse_lower_saves(ckdir):
    for s in (100, 200):
        zerostall.save(ckdir, st(s), step=s)
    with zerostall.Checkpointer(ckdir, keep_last=2) as c:
        with pytest.raises(StepOrderError, match="step 0 is lower than step 200") as ei:
            c.save(0, st(0))
        assert ei.value.step == 0 and ei.value.newest == 200
        assert c.tier.steps() == [100, 200] and c.tier.leftovers() == []
        _durable_then_present(c, 210)  # continuing the run is fine
    assert zerostall.load(ckdir)["i"] == 210


def test_allow_lower_steps_never_prunes_the_new_runs_recent_saves(ckdir):
    for s in (100, 200):
        zerostall.save(ckdir, st(s), step=s)
    with zerostall.Checkpointer(ckdir, keep_last=2, allow_lower_steps=True) as c:
        _durable_then_present(c, 0)
        _durable_then_present(c, 10)
        assert c.tier.steps() == [0, 10, 100, 200]
        _durable_then_present(c, 20)  # now 0 is beyond this run's keep_last
        assert c.tier.steps() == [10, 20, 100, 200]


def test_allow_lower_steps_protection_survives_a_restart(ckdir):
    """"This writer's newest keep_last saves" are the root's last commits (manifest time), so a
    restart neither prunes them at start-up nor at its first save."""
    for s in (100, 200):
        zerostall.save(ckdir, st(s), step=s)
    with zerostall.Checkpointer(ckdir, keep_last=2, allow_lower_steps=True) as c:
        for s in (0, 10, 20):
            _durable_then_present(c, s)
        assert c.tier.steps() == [10, 20, 100, 200]
    with zerostall.Checkpointer(ckdir, keep_last=2, allow_lower_steps=True) as c:
        assert c.tier.steps() == [10, 20, 100, 200]
        _durable_then_present(c, 30)  # 10 is now beyond this run's keep_last; 20 is not
        assert c.tier.steps() == [20, 30, 100, 200]


def test_owner_applies_keep_last_at_start_up(ckdir):
    with zerostall.Checkpointer(ckdir) as c:
        for s in (1, 2, 3, 4, 5):
            c.save(s, st(s)).result()
    os.makedirs(os.path.join(ckdir, "step-900"))  # not a checkpoint: neither counted nor deleted
    with zerostall.Checkpointer(ckdir, keep_last=2) as c:
        assert c.tier.steps() == [4, 5]  # before any save
    assert os.path.isdir(os.path.join(ckdir, "step-900"))
    assert zerostall.load(ckdir)["i"] == 5


class Boom(OSError):
    pass


def _save_failing_at(c, step, point, err, msg):
    """Save ``step`` while the tier's ``point`` (its fault seam) fails with ``Boom(err, msg)``;
    the handle and its record."""
    def hook(name):
        if name == point:
            raise Boom(err, msg)

    c.tier._hook = hook
    try:
        h = c.save(step, st(step))
        return h, h.result()
    finally:
        c.tier._hook = None


def test_latest_hint_failure_leaves_the_step_committed_and_durable(ckdir):
    with zerostall.Checkpointer(ckdir) as c:
        c.save(1, st(1)).result()
        h, rec = _save_failing_at(c, 2, "latest_tmp", errno.ENOSPC, "No space left on device")  # no SaveFailed
        assert h.durable() and h.exception() is None and rec.ok
        assert len(rec.post_commit_errors) == 1 and "latest" in rec.post_commit_errors[0]
        assert "No space left" in rec.post_commit_errors[0] and "committed" in rec.post_commit_errors[0]
        assert "after the commit" in rec.log_line()
        c.save(3, st(3)).result()  # nothing pending is raised
        assert c.records[-1].post_commit_errors == ()
    tier = LocalTier(ckdir)
    assert tier.steps() == [1, 2, 3] and not os.path.exists(os.path.join(ckdir, "latest.tmp"))
    assert zerostall.load(ckdir, step=2)["i"] == 2


def test_retention_failure_is_recorded_not_a_failed_save(ckdir):
    with zerostall.Checkpointer(ckdir, keep_last=1) as c:
        c.save(1, st(1)).result()
        h, rec = _save_failing_at(c, 2, "delete_rename", errno.EIO, "Input/output error")
        assert h.durable() and rec.ok and rec.error == ""
        assert any("retention after step 2 failed" in e for e in rec.post_commit_errors)
        try:
            c.save(3, st(3)).result()
        except SaveFailed:  # pragma: no cover - the assertion below explains
            pytest.fail("a post-commit failure surfaced as a failed save")
    assert zerostall.load(ckdir)["i"] == 3


# A step remote retention would not keep is never uploaded, and close() does not wait for it.

def test_step_older_than_remote_retention_keeps_is_settled_not_pending(tmp_path):
    url = f"file://{tmp_path / 'remote'}"
    with zerostall.Checkpointer(str(tmp_path / "a"), remote=url) as ck:
        ck.save(100, {"w": torch.ones(4)}).wait(tier="remote")
    ck = zerostall.Checkpointer(str(tmp_path / "b"), remote=url, keep_last_remote=1, close_timeout_s=5)
    h = ck.save(5, {"w": torch.zeros(4)})
    h.result()
    ck.close()
    # keep_last_remote=1 with step 100 on the remote: step 5 would be deleted at once, so it is not
    # uploaded, and it is not reported as a replication failure
    assert ck.unreplicated == []
    assert h.replicated() and h.replication_error() is None
    assert zerostall.load(str(tmp_path / "b"))["w"].sum() == 0
