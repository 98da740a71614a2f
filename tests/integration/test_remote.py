"""The remote-tier suite, run for the shared-filesystem tier and for S3 (a real radosgw).

.ci/run starts the S3 server (scripts/s3-server.sh) and sets ZEROSTALL_TEST_S3=1; without
it the S3 half skips locally, and fails in CI.
"""

import contextlib
import os
import shutil
import subprocess
import time
import uuid

import pytest
import torch

import zerostall
from zerostall.cli import main as cli
from zerostall.store.remote import open_tier

from ..s3proxy import FaultyProxy

S3 = os.environ.get("ZEROSTALL_TEST_S3") == "1"
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(__file__)))


@pytest.fixture(params=["file", "s3"])
def remote_url(request, tmp_path, monkeypatch):
    """A fresh remote root; S3 goes through the fault proxy (tests/s3proxy.py) so that
    ``outage`` can take it down without touching the shared radosgw."""
    if request.param == "s3":
        if not S3:
            if os.environ.get("CI"):
                pytest.fail("CI must start the S3 server (scripts/s3-server.sh start) before the tests")
            pytest.skip("no S3 server: run scripts/s3-server.sh start and export its environment")
        proxy = FaultyProxy(os.environ["AWS_ENDPOINT_URL"]).start()
        monkeypatch.setenv("AWS_ENDPOINT_URL", proxy.url)
        _proxies[id(request.node)] = proxy
        yield f"s3://zerostall-remote-test/{uuid.uuid4().hex[:12]}"
        proxy.stop()
        return
    yield f"file://{tmp_path / 'remote'}"


_proxies: dict = {}


@contextlib.contextmanager
def outage(url, request):
    """The remote tier is unreachable inside the block: the proxy drops every request (S3), the
    directory is made immutable (shared filesystem)."""
    if url.startswith("s3://"):
        proxy = _proxies[id(request.node)]
        proxy.down = True
        try:
            yield
        finally:
            proxy.down = False
    else:
        path = url[len("file://"):]
        os.makedirs(path, exist_ok=True)
        subprocess.run(["chattr", "+i", path], check=True)
        try:
            yield
        finally:
            subprocess.run(["chattr", "-i", path], check=True)


def _state(step):
    g = torch.Generator().manual_seed(step)
    return {"w": torch.randn(300_000, generator=g), "step": step, "b": torch.arange(10) * step}


def _same(a, b):
    return torch.equal(a["w"], b["w"]) and torch.equal(a["b"], b["b"]) and a["step"] == b["step"]


def test_three_steps_wipe_local_restore_from_remote(remote_url, tmp_path, capsys):
    local = str(tmp_path / "local")
    with zerostall.Checkpointer(local, remote=remote_url) as ck:
        hs = [ck.save(s, _state(s)) for s in (1, 2, 3)]
        for h in hs:
            assert h.wait(timeout=120, tier="remote") and h.replicated()
    assert cli(["ls", local, "--remote", remote_url, "--json"]) == 0
    import json
    rows = json.loads(capsys.readouterr().out)
    assert {(r["step"], r["tier"]) for r in rows} == {(1, "local+remote"), (2, "local+remote"), (3, "local+remote")}
    shutil.rmtree(local)
    assert _same(zerostall.load(local, remote=remote_url), _state(3))
    assert cli(["ls", remote_url]) == 0
    assert cli(["restore", remote_url, "--to", str(tmp_path / "other"), "--step", "2"]) == 0
    assert _same(zerostall.load(str(tmp_path / "other")), _state(2))


def test_outage_mid_replication_then_recovery(remote_url, tmp_path, request):
    local = str(tmp_path / "local")
    with zerostall.Checkpointer(local, remote=remote_url, keep_last=1) as ck:
        assert ck.save(1, _state(1)).wait(timeout=120, tier="remote")
        with outage(remote_url, request):
            h2 = ck.save(2, _state(2))
            h3 = ck.save(3, _state(3))
            assert h2.result().ok and h3.result().ok  # training saves go on locally
            time.sleep(1.0)
            assert not h2.replicated()
            # keep_last=1, but unreplicated local copies are never deleted
            assert {2, 3} <= set(ck.steps(include_remote=False))
        assert h2.wait(timeout=180, tier="remote") and h3.wait(timeout=180, tier="remote")
        assert h3.replicated() and h3.replication_error() is None
    assert ck.unreplicated == []
    remote = open_tier(remote_url)
    assert {2, 3} <= set(remote.steps())
    shutil.rmtree(local)
    assert _same(zerostall.load(local, remote=remote_url), _state(3))


def test_corrupt_remote_object_falls_back(remote_url, tmp_path):
    local = str(tmp_path / "local")
    with zerostall.Checkpointer(local, remote=remote_url) as ck:
        for s in (1, 2):
            ck.save(s, _state(s)).wait(timeout=120, tier="remote")
    remote = open_tier(remote_url)
    name = _shard_name(local, 2)
    rel = f"step-2/{name}"
    scratch = str(tmp_path / "scratch.bin")
    remote.download(rel, scratch, os.path.getsize(os.path.join(local, "step-2", name)))
    data = bytearray(open(scratch, "rb").read())
    data[5000] ^= 0x40
    open(scratch, "wb").write(bytes(data))
    remote.upload(scratch, rel)
    shutil.rmtree(local)
    out = zerostall.load(local, remote=remote_url)
    assert _same(out, _state(1))  # step 2's remote copy failed its crc32c; step 1 was used
    assert zerostall.load(local, step=1)["step"] == 1


def test_retention_on_both_tiers(remote_url, tmp_path):
    local = str(tmp_path / "local")
    with zerostall.Checkpointer(local, remote=remote_url, keep_last=2, keep_last_remote=2,
                                keep_every_remote=3) as ck:
        for s in range(1, 8):
            ck.save(s, _state(s)).wait(timeout=120, tier="remote")
    assert ck.steps(include_remote=False) == [6, 7]
    assert open_tier(remote_url).steps() == [3, 6, 7]
    assert ck.steps() == [3, 6, 7] and ck.latest_step() == 7


def test_local_retention_is_derived_from_the_remote_listing(remote_url, tmp_path):
    """keep_last=1 over restarts: each run sees from the remote which local steps are safe to
    delete (in-memory state used to forget this, and the local steps grew by one per restart)."""
    local = str(tmp_path / "local")
    for s in range(1, 5):
        with zerostall.Checkpointer(local, remote=remote_url, keep_last=1) as ck:
            assert ck.save(s, _state(s)).wait(timeout=120, tier="remote")
        assert ck.unreplicated == []
    with zerostall.Checkpointer(local, remote=remote_url, keep_last=1) as ck:
        pass  # a run that saves nothing: its start-up pass applies retention
    assert ck.steps(include_remote=False) == [4]
    assert open_tier(remote_url).steps() == [1, 2, 3, 4]


def _shard_name(local, step):
    return [n for n in os.listdir(os.path.join(local, f"step-{step}")) if n.startswith("rank-")][0]
