"""``zerostall verify`` must not pass a step it could not read at all.

Found by adv2: a step that was never readable (``--step`` of a step that does not exist, or a
listed step directory that is a symlink loop) was taken for one deleted while it was being
verified ("deleted while verifying it (retention?); skipped") and the command exited 0."""

import os

import pytest
import torch

import zerostall
from zerostall.cli.app import main

pytestmark = pytest.mark.timeout(120)


@pytest.fixture
def root(tmp_path):
    d = str(tmp_path / "ck")
    zerostall.save(d, {"x": torch.ones(8)}, step=1)
    return d


def test_verify_of_a_step_that_does_not_exist_fails(root, capsys):
    assert main(["verify", root, "--step", "7"]) == 1
    assert "step 7" in capsys.readouterr().err


def test_verify_of_a_listed_step_that_is_a_symlink_loop_fails(root, capsys):
    os.symlink("step-2", os.path.join(root, "step-2"))
    assert main(["verify", root]) == 1
    out = capsys.readouterr()
    assert "step 1: OK" in out.out and "step 2: FAILED" in out.err


def test_verify_of_an_existing_step_passes(root):
    assert main(["verify", root, "--step", "1"]) == 0
