"""A crash between any two commit steps leaves the previous checkpoint loadable."""

import os

import pytest
import torch

import zerostall
from zerostall.store.local import LocalTier


class Crash(Exception):
    pass


@pytest.mark.parametrize("at", ["manifest", "fsync_dir"])
def test_crash_before_rename_keeps_previous(ckdir, at):
    with zerostall.Checkpointer(ckdir) as c:
        c.save(1, {"x": torch.ones(1000)}).result()

        def hook(name):
            if name == at:
                raise Crash(name)

        c.tier._hook = hook
        h = c.save(2, {"x": torch.zeros(1000)})
        assert isinstance(h.exception(), Crash)
        c.tier._hook = None
        with pytest.raises(zerostall.errors.SaveFailed):
            c.save(3, {"x": torch.zeros(1)})  # the failure surfaces on the next save
    tier = LocalTier(ckdir)
    assert tier.steps() == [1]
    assert zerostall.load(ckdir)["x"].sum().item() == 1000


@pytest.mark.parametrize("at", ["rename", "fsync_root", "latest"])
def test_crash_after_rename_commits(ckdir, at):
    with zerostall.Checkpointer(ckdir, raise_on_background_error=False) as c:
        c.save(1, {"x": torch.ones(10)}).result()

        def hook(name):
            if name == at:
                raise Crash(name)

        c.tier._hook = hook
        c.save(2, {"x": torch.zeros(10)}).wait()
    assert LocalTier(ckdir).steps() == [1, 2]  # the rename is the commit point
    assert zerostall.load(ckdir)["x"].sum().item() == 0


def test_partial_directory_is_ignored_and_cleaned(ckdir):
    zerostall.save(ckdir, {"x": torch.ones(3)}, step=1)
    part = os.path.join(ckdir, "step-2.partial")
    os.mkdir(part)
    with open(os.path.join(part, "rank-00000.shard"), "wb") as f:
        f.write(b"junk" * 1000)
    assert LocalTier(ckdir).steps() == [1]
    assert zerostall.load(ckdir)["x"].sum().item() == 3
    zerostall.Checkpointer(ckdir).close()  # a new checkpointer removes stale partials
    assert not os.path.exists(part)


def test_step_dir_without_manifest_is_not_a_checkpoint(ckdir):
    zerostall.save(ckdir, {"x": torch.ones(3)}, step=1)
    os.mkdir(os.path.join(ckdir, "step-9"))
    assert LocalTier(ckdir).steps() == [1]
