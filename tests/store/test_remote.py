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
from zerostall.store.tier import open_tier

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
        url = f"s3://zerostall-remote-test/{uuid.uuid4().hex[:12]}"
        yield url
        proxy.down = False
        _wipe(url)  # the test server keeps objects in memory: leave nothing behind
        proxy.stop()
        return
    yield f"file://{tmp_path / 'remote'}"


_proxies: dict = {}


def _wipe(url):
    with contextlib.suppress(Exception):
        open_tier(url, attempts=1, read_timeout_s=10)._delete_prefix("")


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


def test_cli_commands_read_urls(remote_url, tmp_path, capsys):
    import json

    from safetensors.torch import load_file
    local = str(tmp_path / "local")
    with zerostall.Checkpointer(local, remote=remote_url) as ck:
        for s in (1, 2):
            assert ck.save(s, _state(s)).wait(timeout=120, tier="remote")
    capsys.readouterr()
    assert cli(["ls", remote_url, "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)
    assert [(r["step"], r["state"]) for r in rows] == [(1, "committed"), (2, "committed")]
    assert cli(["verify", remote_url]) == 0  # streamed from the tier, every byte checked
    out = capsys.readouterr().out
    assert "step 1: OK" in out and "step 2: OK" in out
    assert cli(["inspect", remote_url, "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["step"] == 2
    st = str(tmp_path / "w.safetensors")
    assert cli(["export", remote_url, "--step", "1", st]) == 0
    assert torch.equal(load_file(st)["w"], _state(1)["w"])
    fresh = str(tmp_path / "fresh")
    assert cli(["restore", remote_url, "--to", fresh]) == 0  # a fresh node
    assert _same(zerostall.load(fresh), _state(2))

    # a flipped bit in the remote copy of step 2: verify names the object and fails
    remote = open_tier(remote_url)
    name = _shard_name(local, 2)
    scratch = str(tmp_path / "scratch.bin")
    remote.download(f"step-2/{name}", scratch, os.path.getsize(os.path.join(local, "step-2", name)))
    data = bytearray(open(scratch, "rb").read())
    data[5000] ^= 0x40
    open(scratch, "wb").write(bytes(data))
    remote.upload(scratch, f"step-2/{name}")
    capsys.readouterr()
    assert cli(["verify", remote_url]) == 1
    err = capsys.readouterr().err
    assert "step 2: FAILED" in err and f"step-2/{name}" in err


def test_steps_and_load_include_the_remote(remote_url, tmp_path):
    a, b = str(tmp_path / "a"), str(tmp_path / "b")
    with zerostall.Checkpointer(a, remote=remote_url) as ck:
        assert ck.save(5, _state(5)).wait(timeout=120, tier="remote")
    with zerostall.Checkpointer(b, remote=remote_url) as ck:  # another node: nothing local
        assert ck.steps(include_remote=False) == [] and ck.steps() == [5] and ck.latest_step() == 5
        assert _same(ck.load(), _state(5))  # fetched into b, verified, loaded
        assert ck.steps(include_remote=False) == [5]


def test_docs_remote_md_runs(tmp_path, monkeypatch, capsys, request):
    """docs/remote.md: its python blocks, in order, then its shell commands, against the real
    S3 server (the shared-filesystem tier where there is none)."""
    import re
    import shlex
    text = open(os.path.join(ROOT, "docs", "remote.md")).read()
    assert "docs/remote.md" in open(os.path.join(ROOT, "README.md")).read()
    if S3:
        url = f"s3://zerostall-remote-docs/{uuid.uuid4().hex[:12]}"
        request.addfinalizer(lambda: _wipe(url))
    elif os.environ.get("CI"):
        pytest.fail("CI must start the S3 server (scripts/s3-server.sh start) before the tests")
    else:
        url = f"file://{tmp_path / 'shared'}"
    text = text.replace("s3://my-team-checkpoints/run-42", url)
    monkeypatch.chdir(tmp_path)
    ns: dict = {"__name__": "docs_remote"}
    blocks = re.findall(r"```python\n(.*?)```", text, re.S)
    assert len(blocks) == 3
    for i, b in enumerate(blocks):
        exec(compile(b, f"docs/remote.md (python block {i + 1})", "exec"), ns)  # noqa: S102 - our docs
    shell = re.findall(r"```bash\n(.*?)```", text, re.S)[1]
    for line in shell.splitlines():
        argv = shlex.split(line.split("#")[0].replace("/ckpt", str(tmp_path / "restored")))
        assert argv[0] == "zerostall"
        assert cli(argv[1:]) == 0, line
    assert _same_dict(zerostall.load(str(tmp_path / "restored")), ns["state"])


def _same_dict(a, b):
    return a["step"] == b["step"] and all(torch.equal(a["model"][k], b["model"][k]) for k in a["model"])
