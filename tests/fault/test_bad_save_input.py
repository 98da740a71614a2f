"""Bad input to save: clear errors, nothing half-written."""

import os
import subprocess

import numpy as np
import pytest
import torch

import zerostall
from zerostall.errors import CheckpointExistsError, StorageError, UnsupportedStateError


def _nothing_written(d):
    return not os.path.exists(d) or not [n for n in os.listdir(d) if n.startswith("step-")]


@pytest.mark.parametrize("bad,key", [
    ({"model": {"layer": {"fn": print}}}, "model.layer.fn"),
    ({"opt": [1, 2, object()]}, "opt.2"),
    ({"m": torch.empty(3, device="meta")}, "'m'"),
    ({"sparse": torch.eye(3).to_sparse()}, "sparse"),
    ({"arr": np.array([{"a": 1}], dtype=object)}, "arr"),
    ({"k": {frozenset([1]): 1}}, "dict key"),
])
def test_unstorable_state(ckdir, bad, key):
    with pytest.raises(UnsupportedStateError, match=key):
        zerostall.save(ckdir, bad, step=1)
    assert _nothing_written(ckdir)


def test_keys_that_look_alike_after_flattening_roundtrip(ckdir):
    sd = {"a.b": torch.ones(2), "a": {"b": torch.zeros(2)}}
    zerostall.save(ckdir, sd, step=1)
    out = zerostall.load(ckdir)
    assert out["a.b"].sum() == 2 and out["a"]["b"].sum() == 0


def test_existing_step(ckdir):
    zerostall.save(ckdir, {"x": torch.ones(1)}, step=5)
    with pytest.raises(CheckpointExistsError, match="step 5 already exists.*overwrite=True"):
        zerostall.save(ckdir, {"x": torch.zeros(1)}, step=5)
    assert zerostall.load(ckdir)["x"].item() == 1.0


def test_bad_step_values(ckdir):
    with zerostall.Checkpointer(ckdir) as ck:
        for step in (-1, 1.5, "3", True):
            with pytest.raises(zerostall.errors.ConfigError, match="step="):
                ck.save(step, {"x": torch.ones(1)})


def test_path_is_a_file(tmp_path):
    f = tmp_path / "plain"
    f.write_text("not a directory")
    with pytest.raises(zerostall.errors.ZerostallError, match="is a file"):
        zerostall.save(str(f), {"x": torch.ones(1)}, step=1)
    assert f.read_text() == "not a directory"


def test_read_only_directory(tmp_path):
    d = tmp_path / "ro"
    d.mkdir()
    if subprocess.run(["chattr", "+i", str(d)], capture_output=True).returncode != 0:
        pytest.skip("chattr +i unavailable (root bypasses mode bits, so immutability is the test)")
    try:
        with pytest.raises(StorageError, match="ro'.*(not permitted|Permission denied)"):
            zerostall.save(str(d), {"x": torch.ones(1)}, step=1)
    finally:
        subprocess.run(["chattr", "-i", str(d)])
    assert os.listdir(d) == []
