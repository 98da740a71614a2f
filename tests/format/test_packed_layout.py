"""Layout 2 end to end: small tensors packed into shared page-aligned extents (files and
staging ~1x the data), a checkpoint of an earlier release (manifest versions 1 and 2,
committed under tests/data/layout1; a layout-1 shard, a layout-1 manifest or a re-encoded
envelope written by hand) refused naming the file, its version and what to do, partial
``keys=`` loads, verify and a flipped byte anywhere."""

import json
import os
import shutil

import crc32c
import pytest
import torch

import zerostall
from zerostall.cli import main as cli
from zerostall.config import StagingConfig
from zerostall.errors import CorruptCheckpoint
from zerostall.format.layout import ShardHeader, item_align
from zerostall.saving import pool
from zerostall.store.local import LocalTier
from tests.helpers import flip_byte, seal_manifest

from ..helpers import equal

pytestmark = pytest.mark.timeout(120)
FIXTURE = os.path.join(os.path.dirname(__file__), "..", "data", "layout1")


def _many(n, per, v=1.0):
    g = torch.Generator().manual_seed(int(v))
    return {"optim": {f"state.{i}.exp_avg": torch.randn(per, generator=g) + v for i in range(n)},
            "odd": {"b": torch.arange(3, dtype=torch.int8), "h": torch.ones(5, dtype=torch.bfloat16) * v,
                    "c": torch.zeros(2, dtype=torch.complex128) + v, "big": torch.arange(70_000.0) * v},
            "step": int(v)}


def _data_bytes(sd):
    out = 0
    for v in sd.values():
        if isinstance(v, dict):
            out += _data_bytes(v)
        elif isinstance(v, torch.Tensor):
            out += v.numel() * v.element_size()
    return out


def _fixture_state(v):  # what tests/data/layout1_gen.py saved
    return {"model": {"w": torch.arange(3000, dtype=torch.float32) * v, "b": torch.arange(3, dtype=torch.int64),
                      "h": (torch.arange(100) * 1).to(torch.bfloat16)},
            "optim": {"s": torch.tensor(1.0), "m": torch.arange(20000, dtype=torch.float32) + 1}, "step": int(v)}


def test_files_and_staging_are_about_the_data(tmp_path):
    sd = _many(20_000, 671)  # 2684 B each: 1.5x the data when each took its own 4 KiB page
    data = _data_bytes(sd)
    root = str(tmp_path / "ck")
    with zerostall.Checkpointer(root, staging=StagingConfig(block_bytes=1 << 20)) as ck:
        ck.save(1, sd).result()
        staged = pool.current().arena.ready
    man = LocalTier(root).read_manifest(1)
    shard = os.path.join(root, "step-1", man.files[0].name)
    assert os.path.getsize(shard) <= data * 1.01 + 2 * 4096
    assert data <= staged <= data * 1.05  # one slot, whole 1 MiB blocks
    body = json.loads(open(os.path.join(root, "step-1", "manifest.json"), "rb").read())["body"]
    assert body["alignment"] == 64 and ShardHeader.version_of(open(shard, "rb").read(64)) == 2
    for e in man.tensors:
        assert e.offset % item_align(e.nbytes) == 0
        assert e.offset % torch.empty((), dtype=getattr(torch, e.dtype)).element_size() == 0  # viewable in place
    big = next(e for e in man.tensors if e.key == "odd.big")
    assert big.offset % 4096 == 0
    assert equal(zerostall.load(root), sd)
    part = zerostall.load(root, keys=["optim.state.7.exp_avg", "odd.b", "odd.big"])
    assert torch.equal(part["optim"]["state.7.exp_avg"], sd["optim"]["state.7.exp_avg"])
    assert torch.equal(part["odd"]["big"], sd["odd"]["big"]) and torch.equal(part["odd"]["b"], sd["odd"]["b"])
    assert cli(["verify", root]) == 0


def test_packed_flips_caught_by_load_and_verify(tmp_path, capsys):
    sd = _many(50, 37)  # 148 B tensors: several share each page
    root = str(tmp_path / "ck")
    zerostall.save(root, sd, step=1)
    zerostall.save(root, _many(50, 37, 2.0), step=2)
    man = LocalTier(root).read_manifest(2)
    shard = os.path.join(root, "step-2", man.files[0].name)
    es = sorted(man.tensors, key=lambda e: e.offset)
    gap = next(a.offset + a.nbytes for a, b in zip(es, es[1:]) if b.offset > a.offset + a.nbytes)
    for pos, needle in ((es[10].offset + 5, "crc32c"), (gap, "padding")):
        flip_byte(shard, pos, 0x10)
        assert cli(["verify", root, "--step", "2"]) == 1
        assert needle in capsys.readouterr().err
        with pytest.raises(CorruptCheckpoint, match=needle):
            zerostall.load(root, fallback=False)
        assert zerostall.load(root)["step"] == 1  # fell back
        flip_byte(shard, pos, 0x10)
    assert equal(zerostall.load(root, fallback=False), _many(50, 37, 2.0))


def test_an_earlier_release_checkpoint_is_refused_naming_its_version(tmp_path):
    """A checkpoint written by zerostall before layout 2 (manifest versions 1 and 2): every
    reader refuses each step naming its version and what to do."""
    root = str(tmp_path / "old")
    shutil.copytree(FIXTURE, root)
    body = json.loads(open(os.path.join(root, "step-2", "manifest.json"), "rb").read())["body"]
    assert body["alignment"] == 4096 and body["format_version"] == 2  # written before layout 2, with refs
    for step in (1, 2):
        with pytest.raises(CorruptCheckpoint, match=f"format_version {step} was written by an earlier zerostall; "
                                                    "this zerostall reads only format_version 3: load the checkpoint "
                                                    "with the zerostall that wrote it and save it again"):
            zerostall.load(root, step=step, fallback=False)
    assert cli(["verify", root]) == 1


def test_a_new_run_over_an_earlier_release_root_saves_in_full(tmp_path):
    """A new release continuing an old run: the old steps are ignored (named in the log), its
    first incremental step references none of them, and it loads and verifies."""
    root = str(tmp_path / "old")
    shutil.copytree(FIXTURE, root)
    sd = _fixture_state(2)
    with zerostall.Checkpointer(root, incremental=True) as ck:
        sd["optim"]["s"].add_(1)
        sd["step"] = 3
        ck.save(3, sd).result()
    man = LocalTier(root).read_manifest(3)
    with open(os.path.join(root, "step-3", man.files[0].name), "rb") as f:
        assert ShardHeader.version_of(f.read(64)) == 2
    assert not man.ref_files and all(e.step is None for e in man.tensors)
    assert cli(["verify", root, "--step", "3"]) == 0
    assert equal(zerostall.load(root), sd)


AGAIN = ("was written by an earlier zerostall; this zerostall reads only {what} 2: load the checkpoint with the "
         "zerostall that wrote it and save it again")


def test_a_layout1_shard_is_refused_naming_the_file_and_its_layout(tmp_path, capsys):
    """A shard whose header says layout 1 (every tensor on its own page, what came before),
    written by hand: load and verify name the file, its layout and what to do."""
    root = str(tmp_path / "ck")
    zerostall.save(root, _many(3, 10), step=1)
    shard = os.path.join(root, "step-1", "rank-00000.shard")
    with open(shard, "r+b") as f:
        f.seek(8)  # magic, then the layout version (little-endian u32)
        f.write((1).to_bytes(4, "little"))
    with pytest.raises(CorruptCheckpoint) as ei:
        zerostall.load(root, fallback=False)
    assert shard in str(ei.value)
    assert "shard layout version 1 " + AGAIN.format(what="shard layout version") in str(ei.value)
    assert cli(["verify", root]) == 1
    assert "shard layout version 1 was written by an earlier zerostall" in capsys.readouterr().err


def test_a_layout1_manifest_and_a_reencoded_envelope_are_refused(tmp_path):
    """A manifest whose alignment says layout 1 (4096), and one whose envelope's crc32c covers
    a re-encoding of the body (the sorted form tools wrote), both written by hand: each is
    refused naming the manifest and what to do."""
    root = str(tmp_path / "ck")
    zerostall.save(root, _many(3, 10), step=1)
    path = os.path.join(root, "step-1", "manifest.json")
    body = json.loads(open(path, "rb").read())["body"]
    with open(path, "wb") as f:
        f.write(seal_manifest({**body, "alignment": 4096}))
    with pytest.raises(CorruptCheckpoint, match="manifest.json.*alignment 4096: shard layout version 1 " +
                       AGAIN.format(what="shard layout version")):
        zerostall.load(root, fallback=False)
    canon = json.dumps(body, sort_keys=True, separators=(",", ":")).encode()
    with open(path, "w") as f:
        json.dump({"zerostall_manifest": "crc32c", "body_crc32c": f"{crc32c.crc32c(canon):08x}", "body": body}, f)
    with pytest.raises(CorruptCheckpoint, match="manifest.json.*the envelope is not the one this zerostall writes"):
        zerostall.load(root, fallback=False)
    with open(path, "wb") as f:
        f.write(seal_manifest(body))  # the writer's envelope around the same body loads
    assert equal(zerostall.load(root, fallback=False), _many(3, 10))


def test_manifest_refuses_an_unknown_alignment(tmp_path):
    root = str(tmp_path / "ck")
    zerostall.save(root, _many(3, 10), step=1)
    man = LocalTier(root).read_manifest(1)
    from zerostall.format.manifest import Manifest
    for bad in (32, 4096.0, True):
        raw = Manifest.to_bytes(man).replace(b'"alignment":64', b'"alignment":' + json.dumps(bad).encode())
        body = raw[raw.index(b'"body":') + 7:-2]
        raw = raw.replace(raw[46:54], f"{crc32c.crc32c(body):08x}".encode(), 1)  # resealed
        with pytest.raises(CorruptCheckpoint, match="unsupported alignment"):
            Manifest.from_bytes(raw)
