"""Hostile checkpoints are rejected before any large allocation or read; nothing executes."""

import json
import os
import pickle
import resource

import crc32c
import pytest
import torch

import zerostall
from zerostall.cli import main as cli
from zerostall.errors import CorruptCheckpoint

from tests.helpers import seal_manifest
from tests.manifest_forms import FORMS, edit

MARKER = "/tmp/zerostall-pwned-marker"


class Evil:
    def __reduce__(self):
        return (os.system, (f"touch {MARKER}",))


def _reseal(path, mutate, form="columns"):
    """Edit the body with one dict per tensor; write it back as ``form`` (tests.manifest_forms)."""
    env = json.load(open(path))
    edit(env["body"], mutate, form)
    with open(path, "wb") as f:
        f.write(seal_manifest(env["body"]))


@pytest.fixture
def ckpt(ckdir):
    if os.path.exists(MARKER):
        os.unlink(MARKER)
    zerostall.save(ckdir, {"w": torch.arange(1000, dtype=torch.float32), "m": {"a": 1}}, step=1)
    return ckdir


def _man(ckdir):
    return os.path.join(ckdir, "step-1", "manifest.json")


@pytest.mark.parametrize("mutate,msg", [
    (lambda b: b["files"][0].update(name="../../etc/passwd"), "plain file name"),
    (lambda b: b["files"][0].update(name="/etc/passwd"), "plain file name"),
    (lambda b: b["tensors"][0].update(offset=b["files"][0]["file_bytes"]), "outside"),
    (lambda b: b["tensors"][0].update(shape=[2**31, 2**31, 2**31], nbytes=4 * 2**93), "not an integer|outside"),
    (lambda b: b["tensors"][0].update(shape=[-1000], nbytes=-4000), "shape|nbytes"),
    (lambda b: b["tensors"][0].update(dtype="torch.storage._load_from_bytes"), "unknown dtype"),
    (lambda b: b.update(format_version=2), "format_version"),
    (lambda b: b.update(tree={"pickle": pickle.dumps(Evil()).hex()}), "unknown node tag"),
])
@pytest.mark.parametrize("form", FORMS)
def test_rejected_with_clear_error(ckpt, mutate, msg, form):
    _reseal(_man(ckpt), mutate, form)
    with pytest.raises(CorruptCheckpoint, match=msg):
        zerostall.load(ckpt, fallback=False)
    assert cli(["verify", ckpt]) == 1
    assert not os.path.exists(MARKER)


def test_huge_claim_checked_against_file_before_allocation(ckpt):
    """A manifest promising 1 PiB (consistent with itself) fails on the file's size, not on malloc."""
    def grow(b):
        b["files"][0]["file_bytes"] = 1 << 50
        b["tensors"][0].update(shape=[1 << 47], nbytes=4 << 47)
    _reseal(_man(ckpt), grow)
    from zerostall.saving import pool
    pool.release_now()  # the one-shot save's staging pool reserves the budget as address space
    soft, hard = resource.getrlimit(resource.RLIMIT_AS)
    resource.setrlimit(resource.RLIMIT_AS, (8 << 30, hard))  # an allocation attempt would fail loudly
    try:
        with pytest.raises(CorruptCheckpoint, match="manifest says"):
            zerostall.load(ckpt, fallback=False)
    finally:
        resource.setrlimit(resource.RLIMIT_AS, (soft, hard))


def test_enormous_manifest_rejected_without_reading(ckpt, monkeypatch):
    from zerostall.format import manifest as mf
    monkeypatch.setattr(mf, "MAX_MANIFEST_BYTES", 512)
    from zerostall.store import local
    monkeypatch.setattr(local, "MAX_MANIFEST_BYTES", 512)
    with pytest.raises(CorruptCheckpoint, match="over the 512 limit"):
        zerostall.load(ckpt, fallback=False)


def test_pickle_payloads_never_execute(ckpt):
    blob = pickle.dumps(Evil())
    # as a plain string value in the tree
    _reseal(_man(ckpt), lambda b: b["tree"]["d"].append([{"v": "evil"}, {"v": blob.hex()}]))
    out = zerostall.load(ckpt)
    assert out["evil"] == blob.hex()
    # as a tensor's bytes (checksum fixed up so it verifies): it is data, not code
    shard = os.path.join(ckpt, "step-1", "rank-00000.shard")
    with open(shard, "r+b") as f:
        f.seek(4096)
        f.write(blob)
        f.seek(4096)
        payload = f.read(4000)
    _reseal(_man(ckpt), lambda b: b["tensors"][0].update(crc32c=crc32c.crc32c(payload)))
    out = zerostall.load(ckpt)
    assert out["w"].view(torch.uint8)[:len(blob)].numpy().tobytes() == blob
    assert cli(["inspect", ckpt, "--json"]) == 0
    assert not os.path.exists(MARKER)


def test_symlinked_step_directory_rejected(ckpt, tmp_path):
    outside = tmp_path / "elsewhere"
    os.rename(os.path.join(ckpt, "step-1"), outside)
    os.symlink(outside, os.path.join(ckpt, "step-1"))
    with pytest.raises(zerostall.errors.CorruptCheckpoint, match="symlink"):  # listed as damaged, never read
        zerostall.load(ckpt)
