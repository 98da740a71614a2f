"""S3 faults, against the real radosgw behind a fault-injecting proxy (the seam):
server down at start, throttling (503 SlowDown), a slow server. Nothing lost, training
never blocked, the local copy kept until the remote one is committed."""

import http.client
import http.server
import os
import shutil
import socket
import threading
import time
import uuid

import pytest
import torch

import zerostall
from zerostall.restore import load

S3 = os.environ.get("ZEROSTALL_TEST_S3") == "1"
pytestmark = pytest.mark.skipif(not S3 and not os.environ.get("CI"), reason="needs the S3 server (scripts/s3-server.sh)")


class FaultyProxy:
    """Forwards to radosgw; answers 503 SlowDown to the first ``throttle`` requests, delays the rest."""

    def __init__(self, upstream: str, port: int, throttle: int = 0, delay_s: float = 0.0):
        host, _, uport = upstream.split("//")[1].partition(":")
        self.upstream = (host, int(uport))
        self.throttle, self.delay_s = throttle, delay_s
        self.served_503 = 0
        proxy = self

        class H(http.server.BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *a):
                pass

            def _any(self):
                n = int(self.headers.get("Content-Length") or 0)
                body = self.rfile.read(n) if n else None
                if proxy.served_503 < proxy.throttle:
                    proxy.served_503 += 1
                    msg = b"<?xml version='1.0'?><Error><Code>SlowDown</Code><Message>Reduce your request rate</Message></Error>"
                    self.send_response(503)
                    self.send_header("Content-Length", str(len(msg)))
                    self.end_headers()
                    self.wfile.write(msg)
                    return
                time.sleep(proxy.delay_s)
                c = http.client.HTTPConnection(*proxy.upstream, timeout=60)
                headers = {k: v for k, v in self.headers.items() if k.lower() != "expect"}  # we already said 100
                c.request(self.command, self.path, body=body, headers=headers)
                r = c.getresponse()
                data = r.read()
                self.send_response(r.status)
                for k, v in r.getheaders():
                    if k.lower() not in ("transfer-encoding", "content-length", "connection"):
                        self.send_header(k, v)
                # a HEAD answer carries the object's length, not the (empty) body's
                length = r.getheader("Content-Length") if self.command == "HEAD" else str(len(data))
                self.send_header("Content-Length", length or "0")
                self.end_headers()
                self.wfile.write(data)
                c.close()

            do_GET = do_PUT = do_POST = do_HEAD = do_DELETE = _any

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", port), H)
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    def start(self):
        self.thread.start()
        return self

    def stop(self):
        self.server.shutdown()
        self.server.server_close()


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _state(step):
    g = torch.Generator().manual_seed(step)
    return {"w": torch.randn(200_000, generator=g), "step": step}


@pytest.fixture
def via_proxy(monkeypatch):
    if not S3:
        pytest.fail("CI must start the S3 server before the tests")
    upstream = os.environ["AWS_ENDPOINT_URL"]
    port = _free_port()
    monkeypatch.setenv("AWS_ENDPOINT_URL", f"http://127.0.0.1:{port}")
    return upstream, port, f"s3://zerostall-test/{uuid.uuid4().hex[:12]}"


def test_server_down_at_start(via_proxy, tmp_path):
    upstream, port, url = via_proxy
    local = str(tmp_path / "local")
    with zerostall.Checkpointer(local, remote=url, keep_last=1) as ck:
        h1 = ck.save(1, _state(1))
        h2 = ck.save(2, _state(2))
        assert h1.result().ok and h2.result().ok  # local saves do not wait for the remote
        time.sleep(1.0)
        assert not h1.replicated() and ck.steps() == [1, 2]  # unreplicated: kept despite keep_last=1
        proxy = FaultyProxy(upstream, port).start()
        try:
            assert h2.wait(timeout=180, tier="remote") and h2.replicated()
        finally:
            ck.close()
            proxy.stop()
    shutil.rmtree(local)
    os.environ["AWS_ENDPOINT_URL"] = upstream
    assert load(local, remote=url)["step"] == 2


def test_throttling_and_slow_server(via_proxy, tmp_path):
    upstream, port, url = via_proxy
    proxy = FaultyProxy(upstream, port, throttle=5, delay_s=0.2).start()
    local = str(tmp_path / "local")
    try:
        with zerostall.Checkpointer(local, remote=url) as ck:
            h = ck.save(1, _state(1))
            assert h.result().ok
            assert h.wait(timeout=180, tier="remote") and h.replicated()
        assert proxy.served_503 == 5  # every throttling answer was retried through
    finally:
        proxy.stop()
    os.environ["AWS_ENDPOINT_URL"] = upstream
    shutil.rmtree(local)
    out = load(local, remote=url)
    assert torch.equal(out["w"], _state(1)["w"])
