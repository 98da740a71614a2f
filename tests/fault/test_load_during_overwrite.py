"""A reader loading a step while its writer overwrites it gets a whole step, not a failure.

The overwrite swaps ``step-N`` atomically, but a reader that read the old manifest then opens
the new shard (its header names another checkpoint). ``load()`` must see that the step was
replaced under it and read it again, not report it corrupt (or fall back to an older step).
The seam: an engine that lets the writer overwrite the step just before the reader opens the
shard.
"""

import pytest
import torch

import zerostall
from zerostall import LoadReport
from zerostall.io.base import choose_engine
from zerostall.restore import load


class _OverwriteOnFirstOpen:
    def __init__(self, inner, overwrite):
        self.inner, self.overwrite, self.fired = inner, overwrite, False

    def open_read(self, path):
        if not self.fired:
            self.fired = True
            self.overwrite()
        return self.inner.open_read(path)

    def __getattr__(self, name):
        return getattr(self.inner, name)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("older", [False, True])
def test_load_while_the_step_is_overwritten(tmp_path, older):
    root = str(tmp_path / "ck")
    with zerostall.Checkpointer(root) as ck:
        if older:
            ck.save(1, {"a": torch.full((1000,), 1.0)})
        ck.save(2, {"a": torch.full((1000,), 2.0)})
        ck.wait()

        def overwrite():
            ck.save(2, {"a": torch.full((1000,), 3.0)}, overwrite=True)
            assert ck.wait(60)

        eng = _OverwriteOnFirstOpen(choose_engine(root), overwrite)
        report = LoadReport()
        got = load(root, engine=eng, report=report)
        eng.inner.close()
    assert eng.fired
    assert report.step == 2 and report.failed == []
    assert torch.equal(got["a"], torch.full((1000,), 3.0))
