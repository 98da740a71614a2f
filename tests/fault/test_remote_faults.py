"""S3 faults, against the real radosgw behind a fault-injecting proxy (the seam, tests/s3proxy.py):
down at start, down mid-upload, 503 SlowDown, slow, bytes changed in flight, bad credentials.

What must hold in each: training's saves go on (local commits succeed), ``close()`` returns
within ``close_timeout_s`` and records the steps it could not replicate, restoring from the
local tier works while the remote is down, remote errors are ``RemoteError`` naming the URL
and step, and the next run on the root uploads what is missing.
"""

import contextlib
import os
import uuid

import pytest
import torch

import zerostall
from zerostall.cli import main as cli
from zerostall.errors import RemoteError
from zerostall.store.local import LocalTier
from zerostall.store.files import file_crc32c
from zerostall.store.tier import open_tier

from ..s3proxy import FaultyProxy, free_port

S3 = os.environ.get("ZEROSTALL_TEST_S3") == "1"
pytestmark = [pytest.mark.skipif(not S3 and not os.environ.get("CI"), reason="needs the S3 server "
                                 "(scripts/s3-server.sh)"), pytest.mark.timeout(300)]
BUCKET = "zerostall-remote-faults"


class S3Env:
    def __init__(self, upstream, port, url):
        self.upstream, self.port, self.url = upstream, port, url
        self.proxies = []

    def proxy(self, **kw):
        p = FaultyProxy(self.upstream, self.port, **kw).start()
        self.proxies.append(p)
        return p

    @contextlib.contextmanager
    def direct(self):
        """Talk to radosgw itself (for the test's own checks)."""
        old = os.environ["AWS_ENDPOINT_URL"]
        os.environ["AWS_ENDPOINT_URL"] = self.upstream
        try:
            yield open_tier(self.url)
        finally:
            os.environ["AWS_ENDPOINT_URL"] = old


@pytest.fixture
def s3(monkeypatch):
    if not S3:
        pytest.fail("CI must start the S3 server before the tests")
    upstream = os.environ["AWS_ENDPOINT_URL"]
    port = free_port()
    monkeypatch.setenv("AWS_ENDPOINT_URL", f"http://127.0.0.1:{port}")
    env = S3Env(upstream, port, f"s3://{BUCKET}/{uuid.uuid4().hex[:12]}")
    yield env
    for p in env.proxies:
        p.stop()
    with env.direct() as remote, contextlib.suppress(Exception):
        remote._delete_prefix("")  # the test server keeps objects in memory: leave nothing behind


def _state(step):
    g = torch.Generator().manual_seed(step)
    return {"w": torch.randn(200_000, generator=g), "step": step}


def _same(a, step):
    return torch.equal(a["w"], _state(step)["w"]) and a["step"] == step


def _next_run_uploads(s3, local, expect_remote, keep_last=None):
    """A new Checkpointer on the root, server healthy: its start-up pass uploads what is missing."""
    ck = zerostall.Checkpointer(local, remote=s3.url, keep_last=keep_last, close_timeout_s=120)
    ck.close()
    assert ck.unreplicated == []
    with s3.direct() as remote:
        assert remote.steps() == expect_remote


def test_down_at_start(s3, tmp_path):
    local = str(tmp_path / "local")
    ck = zerostall.Checkpointer(local, remote=s3.url, keep_last=1, close_timeout_s=20)
    hs = [ck.save(s, _state(s)) for s in (1, 2)]
    assert all(h.result().ok for h in hs)  # training's saves do not wait for the remote
    assert ck.steps(include_remote=False) == [1, 2]  # unreplicated: kept despite keep_last=1
    assert ck.latest_step() == 2  # the remote cannot be listed: a warning, local steps
    ck.close()
    assert ck.unreplicated == [1, 2]
    for s, h in zip((1, 2), hs):
        err = h.replication_error()
        assert not h.replicated() and isinstance(err, RemoteError)
        assert err.step == s and s3.url in str(err)
    assert _same(zerostall.load(local, remote=s3.url), 2)  # restore from local while the remote is down

    s3.proxy()  # the server is back: the next run uploads both, then local retention applies
    _next_run_uploads(s3, local, [1, 2], keep_last=1)
    assert LocalTier(local).steps() == [2]
    assert _same(zerostall.load(str(tmp_path / "fresh"), remote=s3.url), 2)


def test_down_mid_upload(s3, tmp_path):
    proxy = s3.proxy(die_on_put=True)
    local = str(tmp_path / "local")
    with zerostall.Checkpointer(local, remote=s3.url, close_timeout_s=20) as ck:
        h1 = ck.save(1, _state(1))
        h2 = ck.save(2, _state(2))
        assert h1.result().ok and h2.result().ok
    assert proxy.down and proxy.dropped >= 1  # the server died inside a shard upload
    assert ck.unreplicated == [1, 2]
    assert isinstance(h1.replication_error(), RemoteError) and not h1.replicated()
    assert _same(zerostall.load(local, remote=s3.url), 2)
    with s3.direct() as remote:
        assert remote.steps() == []  # no manifest went up: nothing half-uploaded counts

    proxy.down = False
    _next_run_uploads(s3, local, [1, 2])
    fresh = str(tmp_path / "fresh")
    assert _same(zerostall.load(fresh, remote=s3.url, step=1), 1)
    assert _same(zerostall.load(fresh, remote=s3.url), 2)


def test_slowdown_503(s3, tmp_path):
    proxy = s3.proxy(throttle=5)
    with zerostall.Checkpointer(str(tmp_path / "local"), remote=s3.url) as ck:
        h = ck.save(1, _state(1))
        assert h.result().ok
        assert h.wait(timeout=180, tier="remote") and h.replicated()
    assert ck.unreplicated == []
    assert proxy.served_503 == 5  # every throttling answer was retried through
    assert _same(zerostall.load(str(tmp_path / "fresh"), remote=s3.url), 1)


def test_slow_server_close_deadline(s3, tmp_path):
    proxy = s3.proxy(delay_s=2.0)
    local = str(tmp_path / "local")
    ck = zerostall.Checkpointer(local, remote=s3.url, close_timeout_s=1)
    h = ck.save(1, _state(1))
    assert h.result().ok
    ck.close()  # returns at its deadline, not when the slow uploads would finish
    assert ck.unreplicated == [1]
    assert isinstance(h.replication_error(), RemoteError) and not h.replicated()
    proxy.delay_s = 0.0
    _next_run_uploads(s3, local, [1])


def test_bytes_changed_in_flight_are_caught(s3, tmp_path):
    proxy = s3.proxy(corrupt_puts=1)
    local = str(tmp_path / "local")
    with zerostall.Checkpointer(local, remote=s3.url) as ck:
        h = ck.save(1, _state(1))
        assert h.wait(timeout=180, tier="remote") and h.replicated()
    assert proxy.corrupted == 1  # the server stored other bytes once; the read-back caught it
    name = [n for n in os.listdir(os.path.join(local, "step-1")) if n.startswith("rank-")][0]
    with s3.direct() as remote:
        assert remote.checksum(f"step-1/{name}") == file_crc32c(os.path.join(local, "step-1", name))


def test_errors_name_the_url_and_are_not_retried_on_4xx(s3, tmp_path, monkeypatch, capsys):
    with pytest.raises(RemoteError) as ei:  # down, nothing local
        zerostall.load(str(tmp_path / "fresh"), remote=s3.url)
    assert s3.url in str(ei.value)
    assert cli(["ls", s3.url]) == 1  # a remote error: one line naming it, exit 1
    err = capsys.readouterr().err
    assert s3.url in err and "Traceback" not in err
    local = str(tmp_path / "local")
    zerostall.save(local, _state(1), step=1)
    assert cli(["ls", local, "--remote", s3.url]) == 0  # the local listing, and a warning
    captured = capsys.readouterr()
    assert "cannot list" in captured.err and s3.url in captured.err and "step" in captured.out

    proxy = s3.proxy()
    with monkeypatch.context() as m, pytest.raises(RemoteError) as ei:
        m.setenv("AWS_SECRET_ACCESS_KEY", "wrong")
        open_tier(s3.url).steps()
    assert "AWS_SECRET_ACCESS_KEY" in str(ei.value) or "credentials" in str(ei.value)
    assert len(proxy.requests) == 1  # a 403 is not retried

