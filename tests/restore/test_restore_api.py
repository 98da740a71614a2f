"""load(): keys=, map_location like torch.load, strict and the key report, transactional
in-place loads, and a reader racing a writer whose retention deletes steps."""

import os
import subprocess
import sys

import pytest
import torch

import zerostall
from zerostall.restore import step as restore
from zerostall.errors import ConfigError, CorruptCheckpoint, StateMismatchError
from zerostall.store.local import LocalTier
from zerostall.memory.arena import Arena

pytestmark = pytest.mark.timeout(180)


def _state(v=1.0):
    return {"model": {"w": torch.full((256, 256), v), "b": torch.full((256,), v)},
            "optim": {"m": torch.full((300_000,), v)}, "model_args": {"n_layer": 2, "name": "tiny"}, "step": int(v)}


def _flip(ckdir, step, key):
    man = LocalTier(ckdir).read_manifest(step)
    e = next(t for t in man.tensors if t.key == key)
    with open(os.path.join(ckdir, f"step-{step}", e.file), "r+b") as f:
        f.seek(e.offset + 5)
        b = f.read(1)
        f.seek(e.offset + 5)
        f.write(bytes([b[0] ^ 1]))


def test_keys_reads_only_those_keys(ckdir):
    zerostall.save(ckdir, _state(1.0), step=1)
    _flip(ckdir, 1, "optim.m")  # damaged bytes that a keys= load must not even read
    out = zerostall.load(ckdir, keys=["model_args", "model.w"])
    assert out == {"model": {"w": out["model"]["w"]}, "model_args": {"n_layer": 2, "name": "tiny"}}
    assert torch.equal(out["model"]["w"], torch.full((256, 256), 1.0))
    with pytest.raises(CorruptCheckpoint, match="optim.m"):
        zerostall.load(ckdir)  # a full load reads every byte
    with pytest.raises(StateMismatchError, match="no key 'nope'"):
        zerostall.load(ckdir, keys=["nope"])
    with pytest.raises(ConfigError):
        zerostall.load(ckdir, keys="model")


@pytest.mark.parametrize("loc,device", [
    (None, "cpu"), ("cpu", "cpu"), (torch.device("cpu"), "cpu"), ("meta", "meta"),
    ({"cpu": "meta"}, "meta"), ({"cuda:0": "cuda:1"}, "cpu"),
    (lambda storage, location: storage, "cpu"), (lambda storage, location: None, "cpu"),
    (lambda storage, location: torch.empty(0, device="meta").untyped_storage(), "meta"),
])
def test_map_location_like_torch_load(ckdir, loc, device):
    emb = torch.randn(4, 3)
    zerostall.save(ckdir, {"emb": emb, "head": emb, "x": torch.ones(2)}, step=1)
    out = zerostall.load(ckdir, map_location=loc)
    assert out["x"].device.type == device and out["emb"].device.type == device
    assert out["emb"] is out["head"]  # tied weights stay tied after the move
    if device == "cpu":
        assert torch.equal(out["emb"], emb)


def test_bad_map_location_fails_before_reading(ckdir):
    zerostall.save(ckdir, {"x": torch.ones(2)}, step=1)
    with pytest.raises(ConfigError, match="map_location"):
        zerostall.load(ckdir, map_location=3.5)
    with pytest.raises(ConfigError, match="not a device"):
        zerostall.load(ckdir, map_location="nodevice")


def test_strict_and_the_key_report(ckdir):
    zerostall.save(ckdir, _state(1.0), step=1)
    sd = {"model": {"w": torch.zeros(256, 256), "b": torch.zeros(256), "extra": torch.zeros(3)}}
    with pytest.raises(StateMismatchError, match=r"missing keys \['model.extra'\]"):
        zerostall.load(ckdir, sd, strict=True)
    assert sd["model"]["w"].sum() == 0  # nothing touched
    rep = zerostall.LoadReport()
    zerostall.load(ckdir, sd, report=rep)
    assert rep.step == 1 and rep.source == "local" and rep.failed == []
    assert rep.missing_keys == ["model.extra"]
    assert rep.unexpected_keys == ["model_args.n_layer", "model_args.name", "optim.m", "step"]
    assert sd["model"]["w"].sum() == 256 * 256 and sd["step"] == 1 and "optim" in sd


def test_shape_mismatch_raises_without_touching_or_falling_back(ckdir):
    zerostall.save(ckdir, _state(1.0), step=1)
    zerostall.save(ckdir, {"model": {"w": torch.ones(4, 4), "b": torch.ones(256)}}, step=2)
    sd = {"model": {"w": torch.zeros(256, 256), "b": torch.zeros(256)}}
    with pytest.raises(StateMismatchError, match="model.w"):
        zerostall.load(ckdir, sd)  # the newest step does not fit: an older one would hide that
    assert sd["model"]["b"].sum() == 0


def test_in_place_fallback_leaves_no_byte_of_the_failed_step(ckdir):
    zerostall.save(ckdir, _state(1.0), step=1)
    s2 = _state(2.0)
    s2["optim"]["new_buffer"] = torch.full((1000,), 2.0)
    zerostall.save(ckdir, s2, step=2)
    _flip(ckdir, 2, "optim.m")  # the last tensor of step 2 fails its crc32c after the others were read
    sd = {"model": {"w": torch.zeros(256, 256), "b": torch.zeros(256)},
          "optim": {"m": torch.zeros(300_000), "new_buffer": torch.full((1000,), -1.0)}}
    rep = zerostall.LoadReport()
    zerostall.load(ckdir, sd, report=rep)
    assert rep.step == 1 and len(rep.failed) == 1 and "crc32c" in rep.failed[0]
    assert torch.equal(sd["model"]["w"], torch.full((256, 256), 1.0))
    assert torch.equal(sd["optim"]["new_buffer"], torch.full((1000,), -1.0))  # not step 2's bytes
    assert rep.missing_keys == ["optim.new_buffer"]


def test_two_pass_when_scratch_would_not_fit(ckdir, monkeypatch, caplog):
    """Without room for the staged bytes (a bounce smaller than the step), a verify-only pass
    runs before the caller's are written."""
    monkeypatch.setattr(restore, "_bounce", Arena(1 << 20, mlock=False))
    zerostall.save(ckdir, _state(1.0), step=1)
    zerostall.save(ckdir, _state(2.0), step=2)
    _flip(ckdir, 2, "optim.m")
    sd = {"model": {"w": torch.zeros(256, 256), "b": torch.zeros(256)}, "optim": {"m": torch.zeros(300_000)}}
    ptr = sd["optim"]["m"].data_ptr()
    with caplog.at_level("INFO", logger="zerostall"):
        zerostall.load(ckdir, sd)
    assert "verifying it first" in caplog.text
    assert sd["optim"]["m"].data_ptr() == ptr  # loaded in place
    assert torch.equal(sd["optim"]["m"], torch.full((300_000,), 1.0))
    assert torch.equal(sd["model"]["w"], torch.full((256, 256), 1.0))


def test_step_deleted_while_loading_is_not_a_failure(ckdir, monkeypatch):
    for s in (1, 2, 3):
        zerostall.save(ckdir, _state(float(s)), step=s)
    real = restore.check_files

    def retention_strikes(tier, man, only=None, *a):
        if man.step == 3 and os.path.isdir(tier.step_dir(3)):
            tier.delete(3)  # what a writer's keep_last does between our listing and our read
        return real(tier, man, only, *a)

    monkeypatch.setattr(restore, "check_files", retention_strikes)
    rep = zerostall.LoadReport()
    out = zerostall.load(ckdir, report=rep, fallback=False)
    assert out["step"] == 2 and rep.step == 2 and rep.failed == []


def test_reader_racing_a_pruning_writer(tmp_path):
    """A writer saves 40 steps with keep_last=1 while this process loads 40 times: every load
    returns a step that existed (no CheckpointNotFound, no 'shard missing')."""
    ckdir = str(tmp_path / "ck")
    zerostall.save(ckdir, {"x": torch.zeros(1 << 16), "step": 0}, step=0)
    writer = subprocess.Popen([sys.executable, "-c", f"""
import torch, zerostall
with zerostall.Checkpointer({ckdir!r}, keep_last=1) as ck:
    for s in range(1, 41):
        ck.save(s, {{"x": torch.full((1 << 16,), float(s)), "step": s}}).result()
"""])
    try:
        loads, seen = 0, set()
        while writer.poll() is None or loads < 40:
            out = zerostall.load(ckdir)
            assert out["x"][0].item() == out["step"]  # one step's bytes, never a mix
            seen.add(out["step"])
            loads += 1
    finally:
        writer.wait(timeout=120)
    assert writer.returncode == 0
    assert seen <= set(range(41))  # only steps the writer saved (the loop guarantees >= 40 loads)
    assert LocalTier(ckdir).steps() == [40] and zerostall.load(ckdir)["step"] == 40  # keep_last=1 pruned the rest
