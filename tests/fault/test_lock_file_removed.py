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


@pytest.mark.xfail(strict=True, reason="adv2: the owner never checks that its locked fd is still the "
                   "file at ROOT/.zerostall.lock (st_ino of the path vs fstat of the fd); a second "
                   "Checkpointer then owns the root too. Check it at start-up of a new owner is not "
                   "enough (the old one has no file to conflict on): the writer should re-check before "
                   "each commit and fail the save naming the lock file, and say so in the README")
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
