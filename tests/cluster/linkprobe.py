"""Where the peer fetch loses against the link: one run on the namespace cluster
(:mod:`.harness`) that moves the same bytes n0 -> n1 over the same shaped link, in turns:

- ``bare``: a bare TCP stream (python sockets, bytes from memory into a discarding
  ``recv_into``): what the CPUs let the link carry at this moment;
- ``net``: the peer fetch path (:class:`zerostall.peers.tcp.TcpTransport`: handshake, ``get``,
  the holder's paced ``sendfile`` from its committed file, the receiver's double-buffered
  loop), received into nothing: no crc check, no write;
- ``crc``: the same, every byte checked (:class:`~zerostall.peers.verify.StreamCheck`), no write;
- ``full``: the fetch a restore runs: checked and written with O_DIRECT, fdatasync'ed.

The holder's file is dropped from the page cache before every peer run (a holder's copy was
written with O_DIRECT: it is cold). Each link rate gets its own cluster; the variants alternate
over ``--rounds``; medians are reported, with each as a fraction of the link, of
min(link, disk) and of the bare stream of the same run, and the tbf drop counters.

Run (root, repository root)::

    PYTHONPATH=$PWD/src python -m tests.cluster.linkprobe --mbit 4000 1600 --mib 256 --rounds 3

    # the same run against another tree's code (variants prefixed ``before:``)
    git worktree add /tmp/zs-before main
    PYTHONPATH=$PWD/src python -m tests.cluster.linkprobe --before /tmp/zs-before/src \
        --variants bare net before:net full before:full

A worker of this module runs in each namespace (``serve`` on n0, the variants on n1); the
driver runs on the caller's thread.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import time
from typing import Any

SECRET = b"linkprobe-secret-0123456789"
NAME = "rank-00000.shard"
PORT = 5001
VARIANTS = ["bare", "net", "crc", "full"]


# -- workers (inside a namespace) -----------------------------------------------------------
def _serve(root: str, mib: int) -> None:
    """n0: save step 1 (``mib`` MiB) under ``root`` and serve it as node n0; prints the port."""
    import torch
    import zerostall
    from zerostall.io.base import choose_engine
    from zerostall.peers.store import PeerStore
    from zerostall.peers.tcp import Pacer, TcpTransport
    from zerostall.store.local import LocalTier
    if not os.path.isdir(os.path.join(root, "step-1")):
        g = torch.Generator().manual_seed(0)
        zerostall.save(root, {f"t{i}": torch.randn((mib << 20) // 32, generator=g) for i in range(8)}, 1)
    tier = LocalTier(root)
    tr = TcpTransport(SECRET, "n0", {"n0", "n1"}, timeout_s=60, pacer=Pacer(None), listen_host="0.0.0.0")
    _, port = tr.serve(PeerStore(tier, "n0", lambda: choose_engine(root)))
    print(port, flush=True)
    sys.stdin.read()  # until the driver closes our stdin


class _NullWriter:
    def write(self, extents: Any, overlap: Any = None) -> None:
        if overlap is not None:
            overlap()

    def finish(self) -> None:
        pass

    def close(self) -> None:
        pass


class _NullCheck:
    def feed(self, mv: memoryview) -> None:
        pass

    def digest(self) -> str:
        return ""


class _Timed:
    """Wraps a check or a writer: seconds spent in ``feed``/``write`` (the fetch thread's own work)."""

    def __init__(self, inner: Any, times: dict[str, float]):
        self.inner, self.times = inner, times

    def feed(self, mv: memoryview) -> None:
        t = time.perf_counter()
        self.inner.feed(mv)
        self.times["crc_s"] = self.times.get("crc_s", 0.0) + time.perf_counter() - t

    def write(self, extents: Any, overlap: Any = None) -> None:
        t = time.perf_counter()
        self.inner.write(extents, overlap)
        self.times["write_s"] = self.times.get("write_s", 0.0) + time.perf_counter() - t

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)


def _get(variant: str, host: str, port: int, root: str) -> None:
    """n1: one fetch of n0's file in ``variant``; prints bytes/s."""
    from zerostall.io.base import choose_engine
    from zerostall.peers.tcp import Pacer, TcpTransport
    from zerostall.peers.wire import Endpoint
    from zerostall.peers.verify import StreamCheck
    tr = TcpTransport(SECRET, "n1", {"n0", "n1"}, timeout_s=60, pacer=Pacer(None))
    path = os.path.join(root, "fetched.shard")
    if os.path.exists(path):
        os.unlink(path)
    engine = choose_engine(root)
    opened: list[Any] = []
    times: dict[str, float] = {}

    def sink(man: Any, size: int) -> tuple[Any, Any]:
        check = _NullCheck() if variant == "net" else StreamCheck(man, NAME, "probe")
        w = engine.open_write(path, size) if variant == "full" else _NullWriter()
        opened.append((w, size))
        return _Timed(w, times), _Timed(check, times)
    t0 = time.perf_counter()
    tr.get(Endpoint("n0", host, port), "n0", 1, NAME, sink)
    w, size = opened[0]
    w.finish()
    dt = time.perf_counter() - t0
    w.close()
    print(json.dumps({k: round(v, 3) for k, v in times.items()} | {"total_s": round(dt, 3)}), flush=True)
    print(size / dt, flush=True)


def _sink() -> None:
    s = socket.create_server(("0.0.0.0", PORT))
    buf = bytearray(4 << 20)
    while True:
        c, _ = s.accept()
        while c.recv_into(buf):
            pass
        c.close()


def _send(host: str, mib: int) -> None:
    s = socket.create_connection((host, PORT))
    b = bytes(4 << 20)
    t = time.perf_counter()
    for _ in range(mib // 4):
        s.sendall(b)
    s.shutdown(socket.SHUT_WR)
    s.recv(1)
    print(mib * (1 << 20) / (time.perf_counter() - t), flush=True)


# -- driver ---------------------------------------------------------------------------------
def _uncache(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def _drops(c: Any) -> int:
    """tbf drops on every shaped device of the cluster so far."""
    n = 0
    for ns, dev in [(c.bridge_ns, nd.port) for nd in c.nodes] + [(nd.ns, "eth0") for nd in c.nodes]:
        out = subprocess.run(["tc", "-n", ns, "-s", "qdisc", "show", "dev", dev], capture_output=True, text=True).stdout
        for tok in out.replace(",", " ").split("dropped")[1:]:
            n += int(tok.split()[0])
    return n


def probe(mbit: float, mib: int, rounds: int, work: str, variants: list[str] = VARIANTS,
          before: str | None = None) -> dict[str, Any]:
    from .harness import Cluster
    env = {"PYTHONPATH": os.pathsep.join([os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(
        os.path.abspath(__file__)))), "src"), os.environ.get("PYTHONPATH", "")]), "PYTHONUNBUFFERED": "1"}
    me = [sys.executable, "-m", "tests.cluster.linkprobe"]
    with Cluster(2, rate_mbit=mbit, base=os.path.join(work, f"c{int(mbit)}")) as c:
        n0, n1 = c.nodes
        srv = n0.spawn([*me, "serve", n0.root, str(mib)], env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                       text=True)
        port = int(srv.stdout.readline())
        ports = {"": port}
        if before:  # the same file served by the other tree's code, on a port of its own
            old = n0.spawn([*me, "serve", n0.root, str(mib)], env={**env, "PYTHONPATH": before}, stdin=subprocess.PIPE,
                           stdout=subprocess.PIPE, text=True)
            ports["before:"] = int(old.stdout.readline())
        sink = n1.spawn([*me, "sink"], env=env)
        time.sleep(1)
        shard = os.path.join(n0.root, "step-1", NAME)
        got: dict[str, list[float]] = {v: [] for v in variants}
        drops: dict[str, int] = {k: 0 for k in got}
        for r in range(rounds):
            order = list(got) if r % 2 == 0 else list(got)[::-1]
            for v in order:
                before = _drops(c)
                if v == "bare":
                    res = n0.run([*me, "send", n1.addr, str(mib)], timeout=600)
                else:
                    if not v.endswith("-warm"):
                        _uncache(shard)
                    tree = "before:" if v.startswith("before:") else ""
                    pre = ["env", f"PYTHONPATH={before}"] if tree else []
                    res = n1.run([*pre, *me, "get", v.removeprefix(tree).removesuffix("-warm"), n0.addr,
                                  str(ports[tree]), n1.root], timeout=600)
                if res.returncode != 0:
                    raise SystemExit(f"linkprobe {v} failed: {res.stderr[-2000:]}")
                lines = res.stdout.strip().splitlines()
                got[v].append(float(lines[-1]))
                if len(lines) > 1:
                    print(f"  {v}: {lines[-2]}", flush=True)
                drops[v] += _drops(c) - before
        srv.stdin.close()
        c.kill(srv)
        c.kill(sink)
    link = mbit * 1e6 / 8
    bare = statistics.median(got["bare"]) if got.get("bare") else float("nan")
    return {"mbit": mbit, "link_Bps": link, "bare_Bps": bare, "runs_Bps": got, "tbf_drops": drops,
            "median_Bps": {k: statistics.median(v) for k, v in got.items()},
            "of_link": {k: statistics.median(v) / link for k, v in got.items()},
            "of_bare": {k: statistics.median(v) / bare for k, v in got.items()}}


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] in ("serve", "get", "sink", "send"):
        if argv[0] == "serve":
            _serve(argv[1], int(argv[2]))
        elif argv[0] == "get":
            _get(argv[1], argv[2], int(argv[3]), argv[4])
        elif argv[0] == "sink":
            _sink()
        else:
            _send(argv[1], int(argv[2]))
        return 0
    ap = argparse.ArgumentParser(prog="python -m tests.cluster.linkprobe", description=__doc__.split("\n\n")[0])
    ap.add_argument("--mbit", type=float, nargs="+", default=[4000, 1600], help="link rates to probe, megabits/s")
    ap.add_argument("--mib", type=int, default=256)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--json", default=None)
    ap.add_argument("--variants", nargs="+", default=VARIANTS,
                    help="of bare, net, crc, full (suffix -warm: the holder's file left in the page cache; prefix "
                         "before: the code of the --before tree, served and fetched by it)")
    ap.add_argument("--before", default=None, help="another tree's src/ (e.g. a checkout of main) for before: variants")
    a = ap.parse_args(argv)
    work = f"/tmp/zs-linkprobe-{os.getpid()}"
    os.makedirs(work, exist_ok=True)
    out: dict[str, Any] = {"load_avg_before": os.getloadavg(), "date_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ",
                                                                                          time.gmtime()), "rates": []}
    try:
        for mbit in a.mbit:
            res = probe(mbit, a.mib, a.rounds, work, a.variants, a.before)
            out["rates"].append(res)
            print(f"{mbit:g} mbit ({res['link_Bps'] / 1e6:.0f} MB/s), load {os.getloadavg()[0]:.1f}: " + ", ".join(
                f"{k} {res['median_Bps'][k] / 1e6:.0f} MB/s ({res['of_link'][k]:.2f} link, {res['of_bare'][k]:.2f} "
                f"bare; drops {res['tbf_drops'][k]})" for k in res["median_Bps"]), flush=True)
    finally:
        import shutil
        shutil.rmtree(work, ignore_errors=True)
    out["load_avg_after"] = os.getloadavg()
    if a.json:
        with open(a.json, "w") as f:
            json.dump(out, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
