"""``load(remote=..., download=False)``: a step only the remote holds streams from the remote
tier straight through the restore pipeline (restore/stream.py), nothing written locally.

Run for the shared-filesystem tier and for S3 (the real radosgw; skipped without
ZEROSTALL_TEST_S3=1 and its environment, see scripts/s3-server.sh).
"""

import os
import uuid

import pytest
import torch

import zerostall
from zerostall.errors import CorruptCheckpoint
from zerostall.restore import step as rstep
from zerostall.store.tier import open_tier
from tests.helpers import equal

pytestmark = pytest.mark.timeout(300)
S3 = os.environ.get("ZEROSTALL_TEST_S3") == "1"


@pytest.fixture(params=["file", "s3"])
def remote_url(request, tmp_path):
    if request.param == "s3":
        if not S3:
            if os.environ.get("CI"):
                pytest.fail("CI must start the S3 server (scripts/s3-server.sh start) before the tests")
            pytest.skip("no S3 server: run scripts/s3-server.sh start and export its environment")
        url = f"s3://zerostall-remote-test/{uuid.uuid4().hex[:12]}"
        yield url
        try:
            open_tier(url, attempts=1, read_timeout_s=10)._delete_prefix("")  # the server keeps objects in RAM
        except Exception:  # noqa: BLE001 - best effort cleanup
            pass
        return
    yield f"file://{tmp_path / 'remote'}"


def _state(v: int) -> dict:
    g = torch.Generator().manual_seed(v)
    return {"model": {"w": torch.randn(600_000, generator=g), "b": torch.arange(10) * v,
                      "h": torch.randn(3000, generator=g).to(torch.bfloat16)},
            "optim": {"m": torch.randn(300_000, generator=g)}, "step": v}


def _replicated(remote_url, tmp_path, steps):
    local = str(tmp_path / "writer")
    with zerostall.Checkpointer(local, remote=remote_url) as ck:
        for s in steps:
            assert ck.save(s, _state(s)).wait(timeout=120, tier="remote")
    return local


def _files_under(root):
    return sorted(os.path.relpath(os.path.join(dp, f), root) for dp, _, fs in os.walk(root) for f in fs)


def test_streamed_new_dict_and_in_place_write_nothing_locally(remote_url, tmp_path):
    _replicated(remote_url, tmp_path, [1, 2])
    local = str(tmp_path / "reader")
    os.makedirs(local)
    rep = zerostall.LoadReport()
    out = zerostall.load(local, remote=remote_url, download=False, report=rep)
    assert equal(out, _state(2)) and rep.step == 2 and rep.source == "remote"
    man = open_tier(remote_url).read_manifest(2)
    assert rstep.last_stats.bytes_read == sum(fe.file_bytes for fe in man.files)  # every byte, streamed
    sd = {"model": {k: torch.zeros_like(t) for k, t in _state(0)["model"].items()},
          "optim": {"m": torch.zeros(300_000)}, "step": 0}
    ptr = sd["model"]["w"].data_ptr()
    zerostall.load(local, sd, step=1, remote=remote_url, download=False)
    assert equal(sd, _state(1)) and sd["model"]["w"].data_ptr() == ptr
    assert _files_under(local) == []  # nothing downloaded
    out = zerostall.load(local, remote=remote_url, download=False, keys=["model.b"])
    assert torch.equal(out["model"]["b"], _state(2)["model"]["b"])
    assert rstep.last_stats.bytes_read < man.files[0].file_bytes // 4  # only that key's range


def test_a_damaged_remote_object_falls_back_and_leaves_the_state_untouched(remote_url, tmp_path):
    _replicated(remote_url, tmp_path, [1, 2])
    tier = open_tier(remote_url)
    man = tier.read_manifest(2)
    e = next(t for t in man.tensors if t.key == "optim.m")
    rel = f"step-2/{e.file}"
    size = next(fe.file_bytes for fe in man.files if fe.name == e.file)
    data = bytearray(tier.read_bytes(rel, size))
    assert len(data) == size
    data[e.offset + 100] ^= 0x40
    tier.put_bytes(bytes(data), rel)
    local = str(tmp_path / "reader")
    sd = {"model": {k: torch.full_like(t, 7) for k, t in _state(0)["model"].items()},
          "optim": {"m": torch.full((300_000,), 7.0)}, "step": 0}
    before = {"model": {k: t.clone() for k, t in sd["model"].items()}, "optim": {"m": sd["optim"]["m"].clone()},
              "step": 0}
    with pytest.raises(CorruptCheckpoint, match=r"optim\.m"):
        zerostall.load(local, sd, step=2, remote=remote_url, download=False, fallback=False)
    assert equal(sd, before)
    rep = zerostall.LoadReport()
    zerostall.load(local, sd, remote=remote_url, download=False, report=rep)
    assert rep.step == 1 and equal(sd, _state(1)) and "optim.m" in " ".join(rep.failed)
    assert not os.path.isdir(local) or _files_under(local) == []
