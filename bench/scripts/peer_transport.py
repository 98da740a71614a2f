"""Peer transport candidates, measured on one machine (loopback): which moves a committed
shard file from one node's disk to another's fastest, and at what CPU cost.

* ``tcp-sendfile``: ``socket.sendfile`` of the file (kernel copies page cache -> socket), the
  receiver ``recv_into`` an aligned buffer (what :mod:`zerostall.peers.tcp` does, minus the
  crc and the O_DIRECT write, so both sides measure the transport alone);
* ``tcp-read+send``: the sender reads the file into a buffer and ``sendall``s it;
* ``gloo``: ``torch.distributed`` send/recv of a uint8 tensor on a gloo group of its own
  (2 processes), the file read into the tensor first (gloo sends memory, not files).

Usage: ``python bench/scripts/peer_transport.py [MiB]`` (default 512); prints GB/s per method
and the sender's + receiver's CPU seconds per GB.
"""

from __future__ import annotations

import os
import socket
import sys
import tempfile
import time

import torch
import torch.multiprocessing as mp

CHUNK = 4 << 20


def _cpu() -> float:
    t = os.times()
    return t.user + t.system


def _recv_all(conn: socket.socket, n: int) -> None:
    buf = bytearray(CHUNK)
    mv = memoryview(buf)
    got = 0
    while got < n:
        k = conn.recv_into(mv[:min(CHUNK, n - got)])
        if not k:
            raise EOFError
        got += k


def _tcp_server(port_q, res_q, n: int) -> None:
    srv = socket.create_server(("127.0.0.1", 0))
    port_q.put(srv.getsockname()[1])
    conn, _ = srv.accept()
    c0 = _cpu()
    _recv_all(conn, n)
    conn.sendall(b"k")
    res_q.put(_cpu() - c0)


def tcp(path: str, n: int, use_sendfile: bool) -> tuple[float, float]:
    ctx = mp.get_context("spawn")
    port_q, res_q = ctx.Queue(), ctx.Queue()
    p = ctx.Process(target=_tcp_server, args=(port_q, res_q, n))
    p.start()
    port = port_q.get()
    s = socket.create_connection(("127.0.0.1", port))
    c0, t0 = _cpu(), time.perf_counter()
    with open(path, "rb") as f:
        if use_sendfile:
            s.sendfile(f)
        else:
            buf = bytearray(CHUNK)
            while (k := f.readinto(buf)):
                s.sendall(memoryview(buf)[:k])
    s.recv(1)
    dt = time.perf_counter() - t0
    cpu = _cpu() - c0 + res_q.get()
    p.join()
    return n / dt / 1e9, cpu / (n / 1e9)


def _gloo(rank: int, path: str, n: int, port: int, res_q) -> None:
    import torch.distributed as dist
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    g = dist.new_group([0, 1], backend="gloo")
    t = torch.empty(n, dtype=torch.uint8)
    dist.barrier(group=g)
    c0, t0 = _cpu(), time.perf_counter()
    if rank == 0:
        with open(path, "rb") as f:
            f.readinto(memoryview(t.numpy()))
        dist.send(t, 1, group=g)
        dist.recv(torch.empty(1, dtype=torch.uint8), 1, group=g)
    else:
        dist.recv(t, 0, group=g)
        dist.send(torch.ones(1, dtype=torch.uint8), 0, group=g)
    res_q.put((rank, time.perf_counter() - t0, _cpu() - c0))
    dist.destroy_process_group()


def gloo(path: str, n: int) -> tuple[float, float]:
    ctx = mp.get_context("spawn")
    res_q = ctx.Queue()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ps = [ctx.Process(target=_gloo, args=(r, path, n, port, res_q)) for r in range(2)]
    for p in ps:
        p.start()
    res = [res_q.get() for _ in ps]
    for p in ps:
        p.join()
    dt = max(r[1] for r in res)
    return n / dt / 1e9, sum(r[2] for r in res) / (n / 1e9)


def main() -> None:
    mib = int(sys.argv[1]) if len(sys.argv) > 1 else 512
    n = mib << 20
    with tempfile.TemporaryDirectory(dir=os.environ.get("TMPDIR", "/tmp")) as d:
        path = os.path.join(d, "shard")
        with open(path, "wb") as f:
            blk = os.urandom(CHUNK)
            for _ in range(n // CHUNK):
                f.write(blk)
        for name, fn in (("tcp-sendfile", lambda: tcp(path, n, True)),
                         ("tcp-read+send", lambda: tcp(path, n, False)),
                         ("gloo-send/recv", lambda: gloo(path, n))):
            best = max((fn() for _ in range(3)), key=lambda r: r[0])
            print(f"{name:16s} {best[0]:6.2f} GB/s  {best[1]:5.2f} CPU s/GB  ({mib} MiB, best of 3, page cache warm)")


if __name__ == "__main__":
    main()
