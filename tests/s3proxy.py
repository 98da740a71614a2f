"""The fault seam for S3 tests: a proxy in front of the real radosgw.

Point ``AWS_ENDPOINT_URL`` at ``FaultyProxy.url``; then, while it runs:

- ``throttle=N``: answer the next N requests with 503 SlowDown;
- ``delay_s``: a slow server (every request waits first);
- ``corrupt_puts=N``: flip one byte in the body of the next N shard PUTs (the server stores
  other bytes than the client sent);
- ``die_on_put=True``: at the first shard PUT, read half its body, drop the connection and
  go down (every later request is dropped unanswered) — the server dying mid-upload;
- ``down=True``: drop every request unanswered.

Not started (or stopped) it is a closed port: connection refused.
"""

from __future__ import annotations

import http.client
import http.server
import socket
import threading
import time

from .helpers import free_port  # noqa: F401  (re-exported: tests import it from here too)

SLOWDOWN = (b"<?xml version='1.0'?><Error><Code>SlowDown</Code>"
            b"<Message>Reduce your request rate</Message></Error>")


class _Server(http.server.ThreadingHTTPServer):
    def handle_error(self, request, client_address):  # a client hanging up is part of the game
        pass


class FaultyProxy:
    def __init__(self, upstream: str, port: int | None = None, *, throttle: int = 0,
                 delay_s: float = 0.0, corrupt_puts: int = 0, die_on_put: bool = False):
        host, _, uport = upstream.split("//")[1].partition(":")
        self.upstream = (host, int(uport))
        self.port = port or free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.throttle, self.delay_s = throttle, delay_s
        self.corrupt_puts, self.die_on_put = corrupt_puts, die_on_put
        self.down = False
        self.served_503 = self.corrupted = self.dropped = 0
        self.requests: list[tuple[str, str]] = []
        self._lock = threading.Lock()
        self.server: http.server.ThreadingHTTPServer | None = None

    def _handler(self) -> type:
        proxy = self

        class H(http.server.BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *a):
                pass

            def _drop(self):
                with proxy._lock:
                    proxy.dropped += 1
                self.close_connection = True
                try:
                    self.connection.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass

            def _any(self):
                with proxy._lock:
                    proxy.requests.append((self.command, self.path))
                    down = proxy.down
                    shard_put = self.command == "PUT" and "/rank-" in self.path
                    die = shard_put and proxy.die_on_put
                    if die:
                        proxy.die_on_put, proxy.down = False, True
                    corrupt = shard_put and not die and proxy.corrupt_puts > 0
                    if corrupt:
                        proxy.corrupt_puts -= 1
                        proxy.corrupted += 1
                    slow = proxy.served_503 < proxy.throttle
                    if slow and not down:
                        proxy.served_503 += 1
                if down:
                    return self._drop()
                n = int(self.headers.get("Content-Length") or 0)
                if die:
                    self.rfile.read(n // 2)
                    return self._drop()
                body = self.rfile.read(n) if n else None
                if slow:
                    self.send_response(503)
                    self.send_header("Content-Length", str(len(SLOWDOWN)))
                    self.end_headers()
                    self.wfile.write(SLOWDOWN)
                    return
                if corrupt and body:
                    b = bytearray(body)
                    b[len(b) // 2] ^= 0x01
                    body = bytes(b)
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

        return H

    def start(self) -> "FaultyProxy":
        self.server = _Server(("127.0.0.1", self.port), self._handler())
        self.server.daemon_threads = True
        threading.Thread(target=self.server.serve_forever, daemon=True).start()
        return self

    def stop(self) -> None:
        if self.server is not None:
            self.server.shutdown()
            self.server.server_close()
            self.server = None

    def __enter__(self) -> "FaultyProxy":
        return self.start()

    def __exit__(self, *a: object) -> None:
        self.stop()
