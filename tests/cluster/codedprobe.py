"""What bounds a wiped node's rebuild from k holders on shaped links: one run on the namespace
cluster (:mod:`.harness`), nothing else running, that moves the same bytes k holders -> n0 in
turns:

- ``bare``: k bare TCP streams at once (python sockets, bytes from memory into a discarding
  ``recv_into``), one per holder: what the links and CPUs carry now;
- ``rebuild``: the restore's rebuild (:func:`zerostall.peers.coded_restore.rebuild`: k fetch
  threads, every piece checked and written with O_DIRECT, synced, committed) of n0's step from
  its RS(k, m) fragments on the holders, with its timeline (per stream: first and last byte).

n0 saves ``--mib`` MiB and sends its fragments to nodes n1..n(k+m) over unshaped links; then
every holder's link is shaped to ``--mbit`` and n0's to ``RECV_X`` times that (the holders'
egress is the limit). Reported per variant (medians of ``--rounds``, alternated): the time,
each stream's MB/s and fraction of its link, and the fraction of the k-link limit
((bytes / k) / link rate over the time).

Run (root, repository root)::

    PYTHONPATH=$PWD/src python -m tests.cluster.codedprobe --mbit 100 --mib 128 --rounds 2

    # against another tree's code in the same run, on a loaded host
    git archive main src | tar -x -C /tmp/zs-before
    PYTHONPATH=$PWD/src python -m tests.cluster.codedprobe --hog 8 --before /tmp/zs-before/src

A worker of this module runs in each namespace; the driver on the caller's thread.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import threading
import time
from typing import Any

SECRET = b"codedprobe-secret-0123456789"
PORT = 5002
RECV_X = 8


def _nodes(n: int) -> list[str]:
    return [f"n{i}" for i in range(n)]


def _transport(me: str, n: int) -> Any:
    from zerostall.peers.tcp import Pacer, TcpTransport
    return TcpTransport(SECRET, me, set(_nodes(n)), timeout_s=60, pacer=Pacer(None), listen_host="0.0.0.0")


def _view(eps: dict[str, Any], n: int) -> Any:
    from zerostall.peers.exchange import PeerView
    from zerostall.peers.exchange import Node
    return PeerView("p", 0, 1, "n0", tuple(Node(x, x) for x in _nodes(n)), ("n0",), eps, SECRET)


def _hold(me: str, root: str, n: int) -> None:
    """A holder: serves fragments (and a bare sender on ``PORT``); prints its port."""
    from zerostall.io.base import choose_engine
    from zerostall.peers.fragments import FragmentStore, register
    from zerostall.peers.store import PeerStore
    from zerostall.store.local import LocalTier
    tier = LocalTier(root, create=True)
    t = _transport(me, n)
    ps = PeerStore(tier, me, lambda: choose_engine(root))
    register(t, FragmentStore(ps), set(_nodes(n)), me, "normal", None)
    print(t.serve(ps)[1], flush=True)
    if os.environ.get("ZS_PROBE_HOG"):  # the holder's own work beside serving (a restart's load): a GIL-bound thread
        threading.Thread(target=lambda: [sum(range(10_000)) for _ in iter(int, 1)], daemon=True).start()
    if os.environ.get("ZS_PROBE_BARE") == "0":
        sys.stdin.read()
        return
    srv = socket.create_server(("0.0.0.0", PORT))

    def bare() -> None:  # a request "<bytes>\n": that many bytes from memory
        while True:
            c, _ = srv.accept()
            want = int(c.makefile().readline())
            b = bytes(4 << 20)
            while want > 0:
                c.sendall(b[:min(len(b), want)])
                want -= min(len(b), want)
            c.close()
    threading.Thread(target=bare, daemon=True).start()
    sys.stdin.read()


def _send(root: str, mib: int, k: int, m: int, eps_json: str) -> None:
    """n0: save step 1 and send its RS(k, m) fragments to n1..n(k+m)."""
    import torch
    import zerostall
    from zerostall.format.manifest import MANIFEST_NAME
    from zerostall.peers.coded import CodedReplicator
    from zerostall.peers.wire import Endpoint
    from zerostall.store.local import LocalTier
    n = k + m + 1
    g = torch.Generator().manual_seed(0)
    zerostall.save(root, {f"t{i}": torch.randn((mib << 20) // 64, generator=g) for i in range(16)}, 1)
    eps = {x: Endpoint(x, h, p) for x, (h, p) in json.loads(eps_json).items()}
    tier = LocalTier(root)
    rep = CodedReplicator(tier, _view(eps, n), _transport("n0", n), None, None, replicas=1, keep_last=None,
                          replica_timeout_s=120, data_fragments=k, parity_fragments=m)
    man = tier.read_manifest(1)
    lay = rep._layout(man)
    raw = open(os.path.join(tier.step_dir(1), MANIFEST_NAME), "rb").read()
    ok, failed = rep._code_and_send(1, lay, raw, lay.describe(1, man.checkpoint_id, "n0"),
                                    {i: f"n{i + 1}" for i in range(k + m)})
    if failed:
        raise SystemExit(f"sending fragments failed: {failed}")
    print(lay.fragment_bytes, flush=True)


def _rebuild(root: str, k: int, m: int, eps_json: str) -> None:
    """n0 (wiped): rebuild step 1 into ``root``; prints the timeline's summary."""
    import shutil
    from zerostall.io.base import choose_engine
    from zerostall.peers.coded_restore import holdings, rebuild
    from zerostall.peers.wire import Endpoint
    from zerostall.store.local import LocalTier
    try:
        from zerostall.peers.coded_decode import Timeline
    except ImportError:  # a --before tree
        class Timeline:  # type: ignore[no-redef]
            def summary(self) -> dict[str, Any]:
                return {"streams": []}
    shutil.rmtree(root, ignore_errors=True)
    eps = {x: Endpoint(x, h, p) for x, (h, p) in json.loads(eps_json).items()}
    n = k + m + 1
    tr = _transport("n0", n)
    view = _view(eps, n)
    coded = holdings(view, tr)
    tier = LocalTier(root, create=True)
    tl = Timeline()
    t0 = time.perf_counter()
    try:
        rebuild(view, tr, tier, lambda: choose_engine(root), 1, coded, timeline=tl)
    except TypeError:  # a --before tree without timelines: the time alone
        rebuild(view, tr, tier, lambda: choose_engine(root), 1, coded)
    print(json.dumps({"total_s": time.perf_counter() - t0, **tl.summary()}), flush=True)


def _bare(hosts: list[str], nbytes: int) -> None:
    """n0: one bare stream of ``nbytes`` from each host at once; prints each one's seconds."""
    out: dict[str, float] = {}

    def one(h: str) -> None:
        s = socket.create_connection((h, PORT))
        s.sendall(f"{nbytes}\n".encode())
        buf = bytearray(4 << 20)
        got, t = 0, time.perf_counter()
        while got < nbytes:
            k = s.recv_into(buf)
            if not k:
                break
            got += k
        out[h] = time.perf_counter() - t
        s.close()
    ts = [threading.Thread(target=one, args=(h,)) for h in hosts]
    t0 = time.perf_counter()
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    print(json.dumps({"total_s": time.perf_counter() - t0, "streams_s": list(out.values())}), flush=True)


def probe(mbit: float, mib: int, rounds: int, k: int, m: int, work: str, hog: int = 0,
          before: str | None = None) -> dict[str, Any]:
    from .harness import Cluster
    src = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "src")
    env = {"PYTHONPATH": os.pathsep.join([src, os.environ.get("PYTHONPATH", "")]), "PYTHONUNBUFFERED": "1",
           **({"ZS_PROBE_HOG": "1"} if hog else {})}
    me = [sys.executable, "-m", "tests.cluster.codedprobe"]
    n = k + m + 1
    with Cluster(n, base=os.path.join(work, "c")) as c:
        holders = []
        eps = {}
        for nd in c.nodes[1:]:
            p = nd.spawn([*me, "hold", nd.name, nd.root, str(n)], env=env, stdin=subprocess.PIPE,
                         stdout=subprocess.PIPE, text=True)
            eps[nd.name] = (nd.addr, int(p.stdout.readline()))
            holders.append(p)
        eps_json = json.dumps(eps)
        trees = {"": (env, eps_json)}
        if before:  # the same fragments served and fetched by another tree's code, on ports of its own
            benv, beps = {**env, "PYTHONPATH": before}, {}
            for nd in c.nodes[1:]:
                p = nd.spawn([*me, "hold", nd.name, nd.root, str(n)], env={**benv, "ZS_PROBE_BARE": "0"},
                             stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
                beps[nd.name] = (nd.addr, int(p.stdout.readline()))
                holders.append(p)
            trees["before:"] = (benv, json.dumps(beps))
        res = c.nodes[0].run([*me, "send", os.path.join(c.nodes[0].root, "src"), str(mib), str(k), str(m), eps_json],
                             timeout=600)
        if res.returncode:
            raise SystemExit(f"codedprobe send failed: {res.stderr[-2000:]}")
        fb = int(res.stdout.split()[-1])
        for nd in c.nodes[1:]:
            c.set_rate(nd, mbit)
        c.set_rate(c.nodes[0], mbit * RECV_X)
        link = mbit * 1e6 / 8
        got: dict[str, list[dict[str, Any]]] = {"bare": [], **{f"{t}rebuild": [] for t in trees}}
        # a loaded machine: busy processes beside the nodes (killed by pid below)
        hogs = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(hog)]
        for r in range(rounds):
            for v in (list(got) if r % 2 == 0 else list(got)[::-1]):
                if v == "bare":
                    cmd = [*me, "bare", json.dumps([c.nodes[i + 1].addr for i in range(k)]), str(fb)]
                else:
                    for nd in c.nodes[1:]:  # a holder's fragment was written O_DIRECT: cold
                        subprocess.run(["sh", "-c", f"for f in {nd.root}/peers/n0/step-1/fragment-*; do "
                                        "dd if=$f iflag=nocache count=0 status=none; done"], check=False)
                    tree = v[:-len("rebuild")]
                    cmd = ["env", f"PYTHONPATH={trees[tree][0]['PYTHONPATH']}", *me, "rebuild",
                           os.path.join(c.nodes[0].root, "new"), str(k), str(m), trees[tree][1]]
                res = c.nodes[0].run(cmd, timeout=600)
                if res.returncode:
                    raise SystemExit(f"codedprobe {v} failed: {res.stderr[-3000:]}")
                doc = json.loads(res.stdout.strip().splitlines()[-1])
                if v == "bare":
                    rates = [fb / s for s in doc["streams_s"]]
                else:
                    rates = [s["Bps"] for s in doc["streams"] if s["end"] == "done"] or [fb / doc["total_s"]]
                got[v].append({"total_s": doc["total_s"], "stream_Bps": rates,
                               "of_k_link": (fb / link) / doc["total_s"], "phases": doc.get("phases", {}),
                               "streams": doc.get("streams", [])})
                print(f"  {v}: {doc['total_s']:.2f} s, {(fb / link) / doc['total_s']:.2f} of the k-link limit; "
                      f"streams " + ", ".join(f"{x / 1e6:.1f}" for x in rates) + " MB/s" +
                      (f"; connected {min(x['connected_s'] for x in doc['streams']):.2f}-"
                       f"{max(x['connected_s'] for x in doc['streams']):.2f} s, first bytes {min(x['first_byte_s'] for x in doc['streams']):.2f}-"
                       f"{max(x['first_byte_s'] for x in doc['streams']):.2f} s, last "
                       f"{max(x['last_byte_s'] or 0 for x in doc['streams']):.2f} s; phases " + ", ".join(
                           f"{w} {a:.2f}-{b:.2f}" for w, (a, b) in doc["phases"].items()) if doc.get("streams") else ""),
                      flush=True)
        for p in holders:
            p.stdin.close()
            c.kill(p)
        for p in hogs:
            p.kill()
            p.wait()
    return {"mbit": mbit, "link_Bps": link, "k": k, "m": m, "fragment_bytes": fb, "k_link_limit_s": fb / link,
            "runs": got, "median_of_k_link": {v: statistics.median(x["of_k_link"] for x in xs)
                                              for v, xs in got.items()},
            "median_stream_of_link": {v: statistics.median(r / link for x in xs for r in x["stream_Bps"])
                                      for v, xs in got.items()}}


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] in ("hold", "send", "rebuild", "bare"):
        if argv[0] == "hold":
            _hold(argv[1], argv[2], int(argv[3]))
        elif argv[0] == "send":
            _send(argv[1], int(argv[2]), int(argv[3]), int(argv[4]), argv[5])
        elif argv[0] == "rebuild":
            _rebuild(argv[1], int(argv[2]), int(argv[3]), argv[4])
        else:
            _bare(json.loads(argv[1]), int(argv[2]))
        return 0
    ap = argparse.ArgumentParser(prog="python -m tests.cluster.codedprobe", description=__doc__.split("\n\n")[0])
    ap.add_argument("--mbit", type=float, default=100.0, help="each holder's link, megabits/s")
    ap.add_argument("--mib", type=int, default=128, help="the wiped node's state, MiB")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--k", type=int, default=4)
    ap.add_argument("--m", type=int, default=2)
    ap.add_argument("--hog", type=int, default=0, help="busy processes beside the nodes, and a GIL-bound thread in "
                    "every holder (a loaded machine where every node loads its own state while it serves)")
    ap.add_argument("--before", default=None, help="another tree's src/: its holders and rebuild too (before:rebuild)")
    ap.add_argument("--json", default=None)
    a = ap.parse_args(argv)
    work = f"/tmp/zs-codedprobe-{os.getpid()}"
    os.makedirs(work, exist_ok=True)
    out: dict[str, Any] = {"load_avg_before": os.getloadavg(),
                           "date_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
    try:
        res = probe(a.mbit, a.mib, a.rounds, a.k, a.m, work, a.hog, a.before)
    finally:
        import shutil
        shutil.rmtree(work, ignore_errors=True)
    out.update(res, load_avg_after=os.getloadavg())
    print(f"RS({a.k},{a.m}), {a.mib} MiB, holders' links {a.mbit:g} mbit: of the k-link limit "
          + ", ".join(f"{v} {x:.2f}" for v, x in res["median_of_k_link"].items()) + "; streams of a link "
          + ", ".join(f"{v} {x:.2f}" for v, x in res["median_stream_of_link"].items()), flush=True)
    if a.json:
        with open(a.json, "w") as f:
            json.dump(out, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
