"""The root lock file removed by a third party while its writer is open.

Found by adv2: after ``rm ROOT/.zerostall.lock`` (a user "clearing a stale lock" after a
RootLockedError, a tmp cleaner removing dotfiles), a second Checkpointer opens the root as
its owner (it locks a new file of that name) while the first keeps saving: two writers, each
of which cleans the other's ``.partial`` directories at start and applies retention to the
other's steps."""

import os

import pytest
import torch

import zerostall
from zerostall.errors import RootLockedError, ZerostallError


def test_second_writer_refused_after_the_lock_file_was_removed(ckdir):
    a = zerostall.Checkpointer(ckdir, lock_timeout_s=0)
    try:
        a.save(1, {"x": torch.ones(2)}).result()
        os.unlink(os.path.join(ckdir, ".zerostall.lock"))
        with pytest.raises(RootLockedError):
            b = zerostall.Checkpointer(ckdir, lock_timeout_s=0)
            b.close()
    finally:
        try:
            a.close()
        except ZerostallError:
            pass
    with zerostall.Checkpointer(ckdir, lock_timeout_s=0) as c:  # once the first closed, the root is free
        assert c.steps() == [1]
