"""The node-loss benchmark on shaped links: 4 nodes (network namespaces, :mod:`.harness`), each
behind a link of ``--link-mbit`` each way; an S3 server (radosgw, ``scripts/s3-server.sh``)
in a namespace of its own behind ``--s3-mbit``; a shared filesystem (a directory on the
host's disk: not behind a link, so its limit is the disk's).

One job saves step 1 with ``replicas=2`` (and a second with ``replicas=3``); n1 uploads its
files to S3 and the shared FS. Then, ``--rounds`` times in alternating order, n1's root is
wiped, every node's files dropped from the page cache, and the job restarted with n1's files
coming from: its one holder (``peers``), its two holders in parallel (``peers N=3``: the file
cut in two ranges), the shared FS, S3. Each is timed from a barrier every rank leaves at once
until n1's files are committed in its root (``files in``) and until n1's collective load
returned, every byte verified (``loaded``).

**Fraction of the physical limit** = (bytes moved / files-in time) / limit, where the limit is
min(every link on the path, the disk's O_DIRECT read, its O_DIRECT write), measured here (the
disk with the line-rate probe of ``zerostall doctor``: io_uring, 4 MiB requests, depth 32). The ratio between tiers is a stated simulation (link
rates we chose); the fraction of the limit is ours to own.

Run (root; from the repository root)::

    PYTHONPATH=$PWD/src python -m tests.cluster.nodeloss_links --mib 512 --link-mbit 4000 \\
        --s3-mbit 1000 --rounds 2 --json bench/results/cluster-nodeloss-<date>.json

Runs on the caller's thread; ranks are :mod:`.bench_worker` processes in the namespaces.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import time
import uuid
from typing import Any

from .harness import Cluster, unavailable

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(os.path.dirname(HERE))
WORKER = os.path.join(HERE, "bench_worker.py")
S3_PORT = 7480


def _uncache(path: str) -> None:
    for d, _, files in os.walk(path):
        for f in files:
            try:
                fd = os.open(os.path.join(d, f), os.O_RDONLY)
            except OSError:
                continue
            try:
                os.fdatasync(fd)
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)


def disk_rates(directory: str, size: int = 512 << 20) -> dict[str, Any]:
    """The disk's O_DIRECT write/read rates in bytes/s (the line-rate probe of ``zerostall doctor``)."""
    from zerostall.tuning.line_rate import line_rate_probe
    r = line_rate_probe(directory, size)
    return {"write_Bps": r["write_gbps"] * 1e9, "read_Bps": r["read_gbps"] * 1e9, "tool": "zerostall probe"}


_SINK = ("import socket\ns = socket.create_server(('0.0.0.0', 5001))\nwhile True:\n    c, _ = s.accept()\n"
         "    while c.recv(1 << 22):\n        pass\n    c.close()\n")
_SEND = ("import socket, sys, time\ns = socket.create_connection((sys.argv[1], 5001))\nb = bytes(4 << 20)\n"
         "t = time.monotonic()\nfor _ in range(int(sys.argv[2])):\n    s.sendall(b)\ns.shutdown(socket.SHUT_WR)\n"
         "s.recv(1)\nprint(int(sys.argv[2]) * (4 << 20) / (time.monotonic() - t))\n")


def bare_stream(c: Cluster, mib: int = 256) -> float:
    """Bytes/s of one bare TCP stream n0 -> n1 over their shaped links (no disk, no zerostall):
    what this machine's CPUs let a link carry at this moment."""
    sink = c.nodes[1].spawn([sys.executable, "-c", _SINK])
    try:
        for _ in range(50):
            if c.nodes[0].run([sys.executable, "-c", f"import socket; socket.create_connection(('{c.nodes[1].addr}', 5001)).close()"]).returncode == 0:
                break
            time.sleep(0.1)
        r = c.nodes[0].run([sys.executable, "-c", _SEND, c.nodes[1].addr, str(mib // 4)], timeout=600)
        return float(r.stdout.strip())
    finally:
        c.kill(sink)


class Bench:
    def __init__(self, c: Cluster, work: str, mib: int, env: dict[str, str]):
        self.c, self.work, self.mib, self.env = c, work, mib, env
        self.runs = 0

    def job(self, mode: str, root_of: dict[str, str], extra: dict[str, str]) -> list[dict[str, Any]]:
        """One run of the 4 ranks (bare launch, n0 hosts the store); their results."""
        self.runs += 1
        outs, procs = [], []
        port = 29500 + self.runs
        for k, nd in enumerate(self.c.nodes):
            out = os.path.join(self.work, f"{mode}-{self.runs}-{nd.name}.json")
            log = open(os.path.join(self.work, f"{mode}-{self.runs}-{nd.name}.log"), "w")
            env = {**self.env, **extra, "ZS_ROOT": root_of[nd.name], "ZS_MIB": str(self.mib), "MASTER_PORT": str(port),
                   "RANK": str(k), "WORLD_SIZE": str(len(self.c.nodes)), "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "1",
                   "ZEROSTALL_BUDGET_BYTES": str(max(64, self.mib + 16) << 20)}
            procs.append(nd.spawn([sys.executable, WORKER, mode, out], env=env, stdout=log, stderr=subprocess.STDOUT))
            outs.append(out)
        for p, out, nd in zip(procs, outs, self.c.nodes):
            if p.wait(1800) != 0 or not os.path.exists(out):
                log = os.path.join(self.work, f"{mode}-{self.runs}-{nd.name}.log")
                raise SystemExit(f"node-loss-links: {nd.name} failed in {mode}:\n{open(log).read()[-3000:]}")
        return [json.load(open(o)) for o in outs]


def run(mib: int, link_mbit: float, s3_mbit: float | None, rounds: int, work: str) -> dict[str, Any]:
    why = unavailable()
    if why:
        raise SystemExit(f"node-loss-links: {why}")
    with Cluster(4, rate_mbit=link_mbit, base=os.path.join(work, "cluster")) as c:
        env = {"PYTHONPATH": os.pathsep.join([os.path.join(REPO, "src"), os.environ.get("PYTHONPATH", "")]),
               "PYTHONUNBUFFERED": "1"}
        s3_env: dict[str, str] = {}
        s3_error = ""
        if s3_mbit and shutil.which("radosgw"):
            s3 = c.add_node("s3", rate_mbit=s3_mbit)
            p = s3.spawn(["bash", os.path.join(REPO, "scripts", "s3-server.sh"), "start"],
                         env={"ZS_S3_DIR": os.path.join(c.base, "s3"), "ZS_S3_HOST": s3.addr,
                              "ZS_S3_PORT": str(S3_PORT)}, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
            out, err = p.communicate(timeout=300)
            if p.returncode == 0:
                for line in out.splitlines():
                    k, _, v = line.removeprefix("export ").partition("=")
                    s3_env[k] = v
            else:
                s3_error = err[-500:]
        elif s3_mbit:
            s3_error = "radosgw not installed (scripts/s3-server.sh install)"
        env.update(s3_env)
        b = Bench(c, work, mib, env)
        roots2 = {nd.name: nd.root for nd in c.nodes}
        roots3 = {nd.name: os.path.join(c.base, "job3", nd.name) for nd in c.nodes}
        for r in roots3.values():
            os.makedirs(r, exist_ok=True)
        shared = os.path.join(work, "shared")
        s3_url = f"s3://zerostall-bench/links-{uuid.uuid4().hex[:8]}" if s3_env else ""
        uploads = " ".join([f"file://{shared}"] + ([s3_url] if s3_url else []))
        saved = b.job("save", roots2, {"ZS_REPLICAS": "2", "ZS_UPLOAD": uploads})
        saved3 = b.job("save", roots3, {"ZS_REPLICAS": "3"})
        disk = disk_rates(os.path.join(work, "cluster"))
        stream = bare_stream(c)
        link_Bps = link_mbit * 1e6 / 8
        tiers = [("peers", roots2, {"ZS_REPLICAS": "2"}, "load"),
                 ("peers N=3", roots3, {"ZS_REPLICAS": "3"}, "load"),
                 ("shared fs", roots2, {"ZS_REMOTE": f"file://{shared}"}, "load_remote")]
        if s3_url:
            tiers.append(("S3", roots2, {"ZS_REMOTE": s3_url}, "load_remote"))
        limits = {"peers": min(link_Bps, disk["read_Bps"], disk["write_Bps"]),
                  "peers N=3": min(link_Bps, 2 * link_Bps, disk["read_Bps"], disk["write_Bps"]),
                  "shared fs": min(disk["read_Bps"], disk["write_Bps"]),
                  "S3": min(link_Bps, (s3_mbit or 0) * 1e6 / 8, disk["write_Bps"])}
        rows: list[dict[str, Any]] = []
        for r in range(rounds):
            row: dict[str, Any] = {}
            for label, roots, extra, mode in (tiers if r % 2 == 0 else tiers[::-1]):
                n1 = roots["n1"]
                shutil.rmtree(n1)
                os.makedirs(n1)
                for root in roots.values():
                    _uncache(root)
                _uncache(shared)
                res = b.job(mode, roots, extra)
                d = res[1]
                row[label] = {"files_s": d["files_s"], "load_s": d["load_s"], "bytes": d["file_bytes"],
                              "fetch_s": d.get("fetch_s"), "source": d["source"],
                              "bit_exact": all(x["equal"] for x in res)}
            rows.append(row)
        out: dict[str, Any] = {
            "scenario": "node-loss-links", "date_utc": datetime.datetime.now(datetime.timezone.utc).isoformat(
                timespec="seconds"),
            "machine": f"{platform.node()} {os.cpu_count()} CPUs, {platform.release()}",
            "load_avg": os.getloadavg(), "mib_per_node": mib, "link_mbit": link_mbit, "s3_mbit": s3_mbit,
            "disk": disk, "bare_stream_Bps": stream, "s3_error": s3_error, "protected": all(d["protected"] for d in saved + saved3),
            "protected_s": max(d["protected_s"] for d in saved), "rounds": rows, "tiers": {}}
        for label, *_ in tiers:
            files = statistics.median(row[label]["files_s"] for row in rows)
            nbytes = rows[0][label]["bytes"]
            out["tiers"][label] = {
                "files_s": files, "load_s": statistics.median(row[label]["load_s"] for row in rows),
                "bytes": nbytes, "rate_Bps": nbytes / files, "limit_Bps": limits[label],
                "fraction_of_limit": nbytes / files / limits[label],
                "fraction_of_bare_stream": nbytes / files / min(limits[label], stream),
                "fraction_each_round": [round(nbytes / row[label]["files_s"] / limits[label], 3) for row in rows],
                "bit_exact": all(row[label]["bit_exact"] for row in rows),
                "source": rows[0][label]["source"]}
            if rows[0][label]["fetch_s"]:
                fetch = statistics.median(row[label]["fetch_s"] for row in rows)
                out["tiers"][label]["fetch_only_s"] = fetch
                out["tiers"][label]["fetch_only_fraction"] = nbytes / fetch / limits[label]
        return out


def report(res: dict[str, Any]) -> str:
    d = res["disk"]
    lines = [f"node-loss on shaped links: 4 nodes x {res['mib_per_node']} MiB, links {res['link_mbit']:g} mbit "
             f"({res['link_mbit'] / 8:g} MB/s) each way per node, S3 behind {res['s3_mbit']} mbit; disk O_DIRECT "
             f"write {d['write_Bps'] / 1e9:.2f} GB/s, read {d['read_Bps'] / 1e9:.2f} GB/s ({d['tool']}); "
             f"{len(res['rounds'])} rounds, medians; load average {res['load_avg'][0]:.1f}; one bare TCP stream "
             f"n0 -> n1 over these links (no disk): {res['bare_stream_Bps'] / 1e6:.0f} MB/s",
             "| tier | files in (s) | loaded (s) | MB/s | limit MB/s | fraction of limit (each round) |",
             "|---|---|---|---|---|---|"]
    for label, t in res["tiers"].items():
        lines.append(f"| {label} | {t['files_s']:.2f} | {t['load_s']:.2f} | {t['rate_Bps'] / 1e6:.0f} | "
                     f"{t['limit_Bps'] / 1e6:.0f} | {t['fraction_of_limit']:.2f} ({', '.join(map(str, t['fraction_each_round']))}) |")
    extra = [f"{k}: fetch alone {t['fetch_only_s']:.2f} s = {t['fetch_only_fraction']:.2f} of the limit"
             for k, t in res["tiers"].items() if "fetch_only_s" in t]
    lines += extra
    lines.append(f"all bit-exact: {all(t['bit_exact'] for t in res['tiers'].values())}; step protected: "
                 f"{res['protected']} after {res['protected_s']:.2f} s" + (f"; S3: {res['s3_error']}" if res["s3_error"] else ""))
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m tests.cluster.nodeloss_links", description=__doc__.split("\n\n")[0])
    ap.add_argument("--mib", type=int, default=256, help="MiB of state per node")
    ap.add_argument("--link-mbit", type=float, default=4000, help="every node's link, megabits/s each way")
    ap.add_argument("--s3-mbit", type=float, default=1000, help="the S3 server's link (0: no S3)")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--dir", default=None, help="work directory (default: a new one under /tmp, removed after)")
    ap.add_argument("--json", default=None, help="write the result document here")
    a = ap.parse_args(argv)
    work = a.dir or os.path.join("/tmp", f"zs-nodeloss-links-{os.getpid()}")
    os.makedirs(work, exist_ok=True)
    try:
        res = run(a.mib, a.link_mbit, a.s3_mbit or None, a.rounds, work)
    finally:
        if a.dir is None:
            shutil.rmtree(work, ignore_errors=True)
    res["command"] = "python -m tests.cluster.nodeloss_links " + " ".join(argv if argv is not None else sys.argv[1:])
    print(report(res))
    if a.json:
        with open(a.json + ".tmp", "w") as f:
            json.dump(res, f, indent=1)
        os.replace(a.json + ".tmp", a.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
