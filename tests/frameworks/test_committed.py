"""``is_committed``: what the integrations take for a resumable checkpoint directory."""

import os

import torch

import zerostall
from zerostall.integrations._common import is_committed


def test_a_partial_with_its_manifest_written_is_not_committed(tmp_path):
    # SIGKILL between the manifest write and the rename leaves exactly this on disk
    part = tmp_path / "checkpoint-8" / "step-8.partial"
    os.makedirs(part)
    (part / "manifest.json").write_bytes(b"{}")
    assert not is_committed(tmp_path / "checkpoint-8")
    assert not is_committed(tmp_path / "missing")


def test_a_committed_step_is_committed(tmp_path):
    zerostall.save(tmp_path / "checkpoint-4", {"w": torch.arange(4.0)}, 4)
    assert is_committed(tmp_path / "checkpoint-4")
