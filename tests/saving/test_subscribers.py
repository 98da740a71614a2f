"""Post-commit stages subscribe to Committed records (the seam peer replicas use next)."""

import torch

import zerostall
from zerostall.saving.job import Committed
from zerostall.store import open_root


class Recorder:
    name = "recorder"

    def __init__(self, fail_on=None):
        self.seen, self.fail_on = [], fail_on

    def on_committed(self, record):
        self.seen.append(record)
        if record.step == self.fail_on:
            raise RuntimeError("the peer is gone")


def test_subscribers_get_each_commit_in_order_and_a_failing_one_never_fails_the_save(ckdir):
    state = {"w": torch.randn(10_000)}
    first, second = Recorder(fail_on=2), Recorder()
    with zerostall.Checkpointer(ckdir, keep_last=2) as ck:
        ck.subscribe(first)
        ck.subscribe(second)
        handles = [ck.save(s, state) for s in (1, 2, 3)]
        recs = [h.result(timeout=60) for h in handles]
    for sub in (first, second):
        assert [r.step for r in sub.seen] == [1, 2, 3]  # every commit, in commit order
        assert all(isinstance(r, Committed) and r.status.durable.is_set() for r in sub.seen)
    assert open_root(ckdir).read_manifest(3).checkpoint_id == first.seen[2].checkpoint_id  # the step committed
    assert recs[1].ok and any("recorder after step 2 failed: the peer is gone" in e
                              for e in recs[1].post_commit_errors)
    assert recs[0].post_commit_errors == () and recs[2].post_commit_errors == ()
    assert zerostall.load(ckdir, step=2)["w"].equal(state["w"])  # committed all the same
