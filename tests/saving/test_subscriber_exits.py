"""A post-commit subscriber that raises a BaseException (``sys.exit()`` in a hook) must not
turn a committed, durable step into a failed save.

Found by adv2: the persist thread's subscriber loop caught ``Exception`` only; a
``SystemExit`` reached the save's failure path after the commit point: the handle raised
SaveFailed for a step that was committed, the log said "nothing committed", the next
``save()`` raised it again as a background failure, and the subscribers after it (retention,
replication) never saw the step."""

import torch

import zerostall


class Exits:
    name = "exits"

    def on_committed(self, record):
        raise SystemExit(3)


class Recorder:
    def __init__(self):
        self.steps = []

    def on_committed(self, record):
        self.steps.append(record.step)


def test_subscriber_raising_systemexit_leaves_the_save_durable(ckdir):
    state = {"w": torch.randn(1000)}
    after = Recorder()
    with zerostall.Checkpointer(ckdir) as ck:
        ck.subscribe(Exits())
        ck.subscribe(after)
        rec = ck.save(1, state).result(timeout=60)  # was SaveFailed
        assert rec.ok and any("exits after step 1 failed" in e for e in rec.post_commit_errors)
        ck.save(2, state).result(timeout=60)  # was SaveFailed: "an earlier background save (step 1) failed"
    assert after.steps == [1, 2]
    assert zerostall.load(ckdir, step=1)["w"].equal(state["w"])
