"""Start-up recovery completes a step the ranks' commit decision committed (its copy recorded
``manifest.decided``) and still removes every other unfinished save (issue 32, item 1)."""

import os
import shutil

import torch

import zerostall
from zerostall.store.local import LocalTier
from zerostall.store.recovery import DECIDED_NAME


def _decided_partial(root, step, as_step=None):
    """``step-<as_step>.partial`` holding ``step``'s shard and its manifest as the decision record."""
    part = os.path.join(root, f"step-{as_step or step}.partial")
    shutil.copytree(os.path.join(root, f"step-{step}"), part)
    os.rename(os.path.join(part, "manifest.json"), os.path.join(part, DECIDED_NAME))
    return part


def test_recovery_completes_a_decided_partial_and_removes_the_rest(tmp_path):
    root = str(tmp_path / "ck")
    zerostall.save(root, {"x": torch.arange(10.0)}, step=1)
    zerostall.save(root, {"x": torch.arange(10.0) * 2}, step=2)
    _decided_partial(root, 2)
    shutil.rmtree(os.path.join(root, "step-2"))  # killed between its record and its rename
    _decided_partial(root, 1, as_step=7)  # a record of another step: not this step's decision
    os.makedirs(os.path.join(root, "step-8.partial"))  # an unfinished save
    tier = LocalTier(root)
    done = tier.own()
    tier.release()
    assert tier.steps() == [1, 2], done
    assert sorted(n for n in os.listdir(root) if n.startswith("step-")) == ["step-1", "step-2"]
    assert any("completed step 2" in line for line in done), done
    assert torch.equal(zerostall.load(root, step=2)["x"], torch.arange(10.0) * 2)
