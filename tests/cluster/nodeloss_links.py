"""The node-loss benchmark on shaped links: 4 nodes (network namespaces, :mod:`.harness`), each
behind a link of a stated rate each way (``--link-mbit``, one or more rates: the cluster is
reshaped between them); an S3 server (radosgw, ``scripts/s3-server.sh``) in a namespace of its
own behind ``--s3-mbit``; a shared filesystem (a directory on the host's disk: not behind a
link, so its limit is the disk's).

One job saves step 1 with ``replicas=2`` (and a second with ``replicas=3``); n1 uploads its
files to S3 and the shared FS. Then, per link rate, a bare TCP stream n0 -> n1 over the links
(what this VM's CPUs let a link carry at that moment), and ``--rounds`` times in alternating
order: n1's root wiped, every node's files dropped from the page cache, the job restarted with
n1's files coming from

- ``peers``: its one holder, the other nodes' loads waiting until n1's files are in (the
  *fetch first* arrangement, below);
- ``peers, loads at once``: the same as a restart runs it, every node loading at once;
- ``peers N=3``: its two holders in parallel (the file cut in two ranges), fetch first;
- ``shared fs``, ``S3``: n1 downloads its shard and the manifest, then the collective load
  (the other ranks wait for n1 in the load's agreement: a download is fetch first by itself).

Each is timed from a barrier every rank leaves at once until n1's files are committed in its
root (``files in``, for peers including the ranks' agreement on what each node can load) and
until n1's collective load returned, every byte verified (``loaded``); ``fetch`` is the fetch
alone (peers: from its start to the files committed; a download: ``files in``).

**Fraction of the physical limit** = (bytes moved / fetch time) / limit, where the limit is
min(every link on the path, the disk's O_DIRECT read, its O_DIRECT write), measured in the same
run (the disk with the line-rate probe of ``zerostall doctor``: io_uring, 4 MiB requests, depth
32). It is also given against min(limit, the bare stream of the same run). The ratio between
tiers is a stated simulation (link rates we chose); the fraction of the limit is ours to own.

**What is simulated, and why fetch first.** The four nodes share this VM's one disk and its
cores; a cluster's nodes do not. When every node loads at once, n1's fetch (the holder reading
the copy, n1 writing it) shares the one disk and two cores with the other three nodes reading
and verifying their own state, so it measures the VM, not the peer tier. In *fetch first* the
other ranks wait at a barrier after the load's fetch step (a wrapper in :mod:`.bench_worker`,
no library change) until n1's files are in: the fetch then has the link path, the holder's
read and n1's write to itself, which is what min(link, disk) describes. On a real cluster the
holder's own disk also serves the holder's own load while it sends: both rows are reported.

Run (root; from the repository root)::

    PYTHONPATH=$PWD/src:$PWD/bench python -m tests.cluster.nodeloss_links --mib 256 --link-mbit 4000 1600 \\
        --s3-mbit 1000 --rounds 2 --json bench/results/cluster-nodeloss-links-<date>.json

Runs on the caller's thread; ranks are :mod:`.bench_worker` processes in the namespaces, one
per node for the whole run.
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


_SINK = ("import socket\ns = socket.create_server(('0.0.0.0', 5001))\nb = bytearray(4 << 20)\nwhile True:\n"
         "    c, _ = s.accept()\n    while c.recv_into(b):\n        pass\n    c.close()\n")
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


class Workers:
    """The 4 ranks (bare launch, n0 hosts the store), one :mod:`.bench_worker` per node for the
    whole run; :meth:`job` sends one command to every rank and returns their answers."""

    def __init__(self, c: Cluster, work: str, mib: int, env: dict[str, str]):
        self.c, self.work = c, work
        self.logs = [os.path.join(work, f"worker-{nd.name}.log") for nd in c.nodes]
        self.procs = []
        for k, nd in enumerate(c.nodes):
            e = {**env, "ZS_MIB": str(mib), "MASTER_PORT": "29500", "RANK": str(k), "WORLD_SIZE": str(len(c.nodes)),
                 "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "1", "ZEROSTALL_BUDGET_BYTES": str(max(64, mib + 16) << 20)}
            self.procs.append(nd.spawn([sys.executable, WORKER], env=e, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                       stderr=open(self.logs[k], "w"), text=True))

    def job(self, mode: str, roots: dict[str, str], **cmd: Any) -> list[dict[str, Any]]:
        for p, nd in zip(self.procs, self.c.nodes):
            p.stdin.write(json.dumps({"mode": mode, "root": roots[nd.name], **cmd}) + "\n")
            p.stdin.flush()
        got = []
        for p, nd, log in zip(self.procs, self.c.nodes, self.logs):
            line = p.stdout.readline()
            if not line:
                raise SystemExit(f"node-loss-links: {nd.name} failed in {mode}:\n{open(log).read()[-3000:]}")
            got.append(json.loads(line))
        return got

    def close(self) -> None:
        for p in self.procs:
            try:
                p.stdin.close()
            except OSError:
                pass
        for p in self.procs:
            try:
                p.wait(60)
            except subprocess.TimeoutExpired:
                self.c.kill(p)


def start_s3(c: Cluster, s3_mbit: float | None) -> tuple[dict[str, str], str]:
    """radosgw in a namespace of its own behind ``s3_mbit``; its client settings, or why not."""
    if not s3_mbit:
        return {}, ""
    if not shutil.which("radosgw"):
        return {}, "radosgw not installed (scripts/s3-server.sh install)"
    s3 = c.add_node("s3", rate_mbit=s3_mbit)
    p = s3.spawn(["bash", os.path.join(REPO, "scripts", "s3-server.sh"), "start"],
                 env={"ZS_S3_DIR": os.path.join(c.base, "s3"), "ZS_S3_HOST": s3.addr, "ZS_S3_PORT": str(S3_PORT)},
                 stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    out, err = p.communicate(timeout=300)
    if p.returncode != 0:
        return {}, err[-500:]
    env = {}
    for line in out.splitlines():
        k, _, v = line.removeprefix("export ").partition("=")
        env[k] = v
    return env, ""


def limits(link_Bps: float, s3_Bps: float, disk: dict[str, Any]) -> dict[str, float]:
    """Each tier's physical limit, bytes/s: min(every link on the path, disk read, disk write)."""
    d = min(disk["read_Bps"], disk["write_Bps"])
    peers = min(link_Bps, d)  # one holder, or two: n1 receives both ranges over its one link
    return {"peers": peers, "peers, loads at once": peers, "peers N=3": peers, "shared fs": d,
            "S3": min(link_Bps, s3_Bps, d)}


def summarize(rows: list[dict[str, Any]], limit: dict[str, float], bare_Bps: float) -> dict[str, Any]:
    """Medians over the rounds of one link rate, per tier, with each fraction of its limit."""
    out: dict[str, Any] = {}
    for label in rows[0]:
        runs = [row[label] for row in rows]
        nbytes = runs[0]["bytes"]
        fetch = statistics.median(r["fetch_s"] for r in runs)
        files = statistics.median(r["files_s"] for r in runs)
        lim = limit[label]
        out[label] = {
            "files_s": files, "load_s": statistics.median(r["load_s"] for r in runs), "fetch_s": fetch,
            "bytes": nbytes, "rate_Bps": nbytes / fetch, "limit_Bps": lim,
            "fraction_of_limit": nbytes / fetch / lim,
            # the shared filesystem is not behind a link: the stream says nothing about it
            "fraction_of_bare_stream": None if label == "shared fs" else nbytes / fetch / min(lim, bare_Bps),
            "files_in_fraction": nbytes / files / lim,
            "fraction_each_round": [round(nbytes / r["fetch_s"] / lim, 3) for r in runs],
            "bit_exact": all(r["bit_exact"] for r in runs), "source": runs[0]["source"],
            "timeline": runs[0].get("timeline")}
    return out


def _timeline(res: list[dict[str, Any]]) -> dict[str, Any]:
    """Seconds after the restart's barrier: the agreement, n1's fetch, each node's load end."""
    return {d["node"]: {"restart_s": round(d.get("restart_s", 0.0), 3), "offer_s": round(d.get("offer_s", 0.0), 3),
                        "fetch": [round(x, 3) for x in d.get("fetch", [])],
                        "reads_from_s": round(d.get("reads_from_s", 0.0), 3), "loaded_s": round(d["load_s"], 3)}
            for d in res}


def run(mib: int, rates_mbit: list[float], s3_mbit: float | None, rounds: int, work: str) -> dict[str, Any]:
    why = unavailable()
    if why:
        raise SystemExit(f"node-loss-links: {why}")
    with Cluster(4, rate_mbit=rates_mbit[0], base=os.path.join(work, "cluster")) as c:
        env = {"PYTHONPATH": os.pathsep.join([os.path.join(REPO, "src"), os.path.join(REPO, "bench"),
                                              os.environ.get("PYTHONPATH", "")]), "PYTHONUNBUFFERED": "1"}
        s3_env, s3_error = start_s3(c, s3_mbit)
        env.update(s3_env)
        roots2 = {nd.name: nd.root for nd in c.nodes}
        roots3 = {nd.name: os.path.join(c.base, "job3", nd.name) for nd in c.nodes}
        for r in roots3.values():
            os.makedirs(r, exist_ok=True)
        shared = os.path.join(work, "shared")
        s3_url = f"s3://zerostall-bench/links-{uuid.uuid4().hex[:8]}" if s3_env else ""
        w = Workers(c, work, mib, env)
        try:
            t_start = time.monotonic()
            saved = w.job("save", roots2, replicas=2, upload=" ".join([f"file://{shared}"] + ([s3_url] if s3_url else [])))
            saved3 = w.job("save", roots3, replicas=3)
            phases = {"saves_s": time.monotonic() - t_start}
            disk = disk_rates(os.path.join(work, "cluster"))
            tiers: list[tuple[str, dict[str, str], str, dict[str, Any]]] = [
                ("peers", roots2, "load", {"replicas": 2, "fetch_first": True}),
                ("peers, loads at once", roots2, "load", {"replicas": 2}),
                ("peers N=3", roots3, "load", {"replicas": 3, "fetch_first": True}),
                ("shared fs", roots2, "load_remote", {"remote": f"file://{shared}"})]
            if s3_url:
                tiers.append(("S3", roots2, "load_remote", {"remote": s3_url}))
            per_rate = []
            for mbit in rates_mbit:
                t_rate = time.monotonic()
                for nd in c.nodes:
                    c.set_rate(nd, mbit)
                bare = bare_stream(c)
                rows: list[dict[str, Any]] = []
                for r in range(rounds):
                    row: dict[str, Any] = {}
                    for label, roots, mode, cmd in (tiers if r % 2 == 0 else tiers[::-1]):
                        shutil.rmtree(roots["n1"])  # n1's disk replaced by an empty one
                        os.makedirs(roots["n1"])
                        for root in list(roots.values()) + [shared]:
                            _uncache(root)
                        res = w.job(mode, roots, **cmd)
                        d = res[1]
                        row[label] = {"files_s": d["files_s"], "load_s": d["load_s"], "bytes": d["file_bytes"],
                                      "fetch_s": d.get("fetch_s") or d["files_s"], "source": d["source"],
                                      "bit_exact": all(x["equal"] for x in res),
                                      "timeline": _timeline(res) if mode == "load" else None}
                    rows.append(row)
                link_Bps = mbit * 1e6 / 8
                lim = limits(link_Bps, (s3_mbit or 0) * 1e6 / 8, disk)
                per_rate.append({"link_mbit": mbit, "link_Bps": link_Bps, "bare_stream_Bps": bare, "rounds": rows,
                                 "tiers": summarize(rows, lim, bare), "load_avg": os.getloadavg(),
                                 "elapsed_s": time.monotonic() - t_rate})
            elapsed = time.monotonic() - t_start
        finally:
            w.close()
        return {
            "scenario": "node-loss-links", "date_utc": datetime.datetime.now(datetime.timezone.utc).isoformat(
                timespec="seconds"),
            "machine": f"{platform.node()} {os.cpu_count()} CPUs, {platform.release()}",
            "load_avg": os.getloadavg(), "mib_per_node": mib, "s3_mbit": s3_mbit, "disk": disk, "s3_error": s3_error,
            "protected": all(d["protected"] for d in saved + saved3), "protected_s": max(d["protected_s"] for d in saved),
            "elapsed_s": elapsed, "phases": phases, "rates": per_rate}


def report(res: dict[str, Any]) -> str:
    d = res["disk"]
    lines = [f"node-loss on shaped links: 4 nodes x {res['mib_per_node']} MiB; S3 behind {res['s3_mbit']} mbit; "
             f"disk O_DIRECT write {d['write_Bps'] / 1e9:.2f} GB/s, read {d['read_Bps'] / 1e9:.2f} GB/s "
             f"({d['tool']}); medians of {len(res['rates'][0]['rounds'])} rounds; load average at the end "
             f"{res['load_avg'][0]:.1f}"]
    for rate in res["rates"]:
        lines += ["", f"links {rate['link_mbit']:g} mbit ({rate['link_Bps'] / 1e6:.0f} MB/s) each way per node; one bare "
                  f"TCP stream n0 -> n1 over them: {rate['bare_stream_Bps'] / 1e6:.0f} MB/s "
                  f"({rate['bare_stream_Bps'] / rate['link_Bps']:.2f} of the link); load average {rate['load_avg'][0]:.1f}",
                  "| tier | files in (s) | loaded (s) | fetch (s) | MB/s | limit MB/s | fraction of limit (rounds) "
                  "| of min(limit, bare TCP) |", "|---|---|---|---|---|---|---|---|"]
        for label, t in rate["tiers"].items():
            lines.append(f"| {label} | {t['files_s']:.2f} | {t['load_s']:.2f} | {t['fetch_s']:.2f} | "
                         f"{t['rate_Bps'] / 1e6:.0f} | {t['limit_Bps'] / 1e6:.0f} | {t['fraction_of_limit']:.2f} "
                         f"({', '.join(map(str, t['fraction_each_round']))}) | "
                         + ("-" if t["fraction_of_bare_stream"] is None else f"{t['fraction_of_bare_stream']:.2f}") + " |")
        for label in ("peers", "peers, loads at once"):
            tl = rate["tiers"].get(label, {}).get("timeline")
            if tl:
                n1 = tl["n1"]
                others = [v for k, v in tl.items() if k != "n1"]
                start = max(v.get("restart_s", 0.0) for v in tl.values())
                lines.append(f"  {label}, round 1 (s after the restart's barrier; the ranks' start-up before it, "
                             f"with the holders' repair copies to n1: {start:.2f}): agreed {n1['offer_s']:.2f}; n1 fetch "
                             f"{n1['fetch'][0]:.2f}-{n1['fetch'][1]:.2f}, loaded {n1['loaded_s']:.2f}; the others "
                             f"read from {min(v['reads_from_s'] for v in others):.2f}, loaded "
                             f"{min(v['loaded_s'] for v in others):.2f}-{max(v['loaded_s'] for v in others):.2f}")
    lines.append(f"all bit-exact: {all(t['bit_exact'] for r in res['rates'] for t in r['tiers'].values())}; step "
                 f"protected: {res['protected']} after {res['protected_s']:.2f} s; measured in {res['elapsed_s']:.0f} s (saves "
                 f"{res['phases']['saves_s']:.0f} s, " + ", ".join(f"{r['link_mbit']:g} mbit {r['elapsed_s']:.0f} s"
                                                                  for r in res["rates"]) + ")"
                 + (f"; S3: {res['s3_error']}" if res["s3_error"] else ""))
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m tests.cluster.nodeloss_links", description=__doc__.split("\n\n")[0])
    ap.add_argument("--mib", type=int, default=256, help="MiB of state per node")
    ap.add_argument("--link-mbit", type=float, nargs="+", default=[4000, 1600],
                    help="every node's link, megabits/s each way (several: each in turn, on the same saved job)")
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
