"""``zerostall bench --scenario node-loss``: 4 simulated nodes x 1 rank on one machine (gloo,
``ZEROSTALL_NODE=n0..n3``, each its own root), ``--size-gib`` of state in all.

In one run:

1. *not replicating*: every node saves step 1 (``replicas=1``); rank 0 trains (a timed matmul
   loop in its own thread of control) before and while the save runs;
2. *paced replication*: the same with ``replicas=2``, ``peers.bandwidth_bytes`` per node, and a
   shared-filesystem remote tier (``file://``); bytes moved per save (what every node's
   leader copied to its holders, acknowledged) against ``(replicas - 1) x state``;
3. node n1 is wiped and the job restarted: n1's ``load()`` fetches its files from its peers;
   the same for a copy of the job saved with ``replicas=3`` ("peers, N=3"): n1's file is cut
   into two ranges fetched from its two holders at once;
4. n1 is wiped again and its files restored from the shared-filesystem tier, then (when
   ``AWS_ENDPOINT_URL`` names an S3 server, e.g. radosgw from ``scripts/s3-server.sh``) from S3:
   the manifest and n1's shard downloaded and committed, then the same collective load;
   steps 3-4 ``--repeat`` times, every other round in reverse order, every node's files and
   the shared tier's dropped from the page cache before each restart (the peers' copies
   were written with O_DIRECT: not cached; a tier run after another must not find its
   files warm); medians and each round's S3/peers ratio are reported.

Steps 3 and 4 are timed alike (:mod:`.nodeloss_worker`): from a barrier every node leaves at
once until n1's files are committed in its root ("files in") and until n1's collective
``Checkpointer.load`` returns, every byte verified ("loaded"); the other nodes load their own
files in the same collective load each time.

Runs on the CLI's thread; the nodes are subprocesses of :mod:`.nodeloss_worker`.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import os
import shutil
import statistics
import tempfile
import uuid
from typing import Any, Iterator

from zerostall.errors import ZerostallError
from .nodes import free_port, node_env, run_nodes
from .report import write_doc

NODES = 4
CAP_BYTES = 200_000_000


def _run(mode: str, base: str, work: str, mib: int, replicas: int | str, bw: int, remote: str,
         cpu: str = "idle") -> list[dict[str, Any]]:
    """The 4 nodes of one phase (``mode``: the worker's), each its own process; their JSON results."""
    port = free_port()
    return run_nodes("node-loss bench", mode, work, NODES,
                     lambda r, out: ["zerostall_bench.nodeloss_worker", mode, base, out, str(mib), str(replicas),
                                     str(bw), remote, cpu],
                     lambda r: dict(node_env(r, NODES, port, mib), MASTER_ADDR="127.0.0.1", ZEROSTALL_NODE=f"n{r}"))


def fetch_from(url: str, tier: Any, rank: int) -> None:
    """A per-rank restore's first half from a remote tier: the manifest and this rank's shard
    downloaded into ``tier`` (the Checkpointer's root) and committed; the collective load that
    follows reads and verifies every byte (what it does after a fetch from peers too)."""
    from zerostall.format.layout import shard_name
    from zerostall.store.tier import open_tier
    remote = open_tier(url)
    man = remote.read_manifest(1)
    part = tier.begin(1)
    name = shard_name(rank)
    size = next(f.file_bytes for f in man.files if f.name == name)
    remote.download(f"step-1/{name}", os.path.join(part, name), size)
    tier.commit(1, man)


def _uncache(path: str) -> None:
    """Drop ``path`` from the page cache: the peers' copies were written with O_DIRECT, so the
    shared-filesystem tier is read from the disk too, not from the cache its upload filled."""
    for d, _, files in os.walk(path):
        for f in files:
            fd = os.open(os.path.join(d, f), os.O_RDONLY)
            try:
                os.fdatasync(fd)
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)


def _upload(root: str, url: str) -> None:
    """n1's shard of step 1 and the manifest, to a remote tier (what its per-rank restore reads)."""
    from zerostall.store.tier import open_tier
    tier = open_tier(url)
    tier.ensure_root()
    tier.upload(os.path.join(root, "step-1", "rank-00001.shard"), "step-1/rank-00001.shard")
    tier.upload_bytes(open(os.path.join(root, "step-1", "manifest.json"), "rb").read(), "step-1/manifest.json")


def _ms(xs: list[float]) -> float:
    return statistics.mean(xs) * 1e3 if xs else 0.0


def run(size_gib: float, work: str, cap: int, rounds: int = 3) -> dict[str, Any]:
    mib = max(1, int(size_gib * 1024 / NODES))
    base, shared = os.path.join(work, "job"), os.path.join(work, "shared")
    plain = _run("save", base, work, mib, 1, 0, "")
    shutil.rmtree(base)
    paced = _run("save", base, work, mib, 2, cap, "")
    _upload(os.path.join(base, "n1"), f"file://{shared}")  # the shared-fs tier: what n1 needs
    _uncache(shared)
    state_bytes = sum(d["state_bytes"] for d in paced)
    base3 = os.path.join(work, "job3")  # the same job with replicas=3: n1's files on two holders
    _run("save", base3, work, mib, 3, cap, "")
    s3_url, s3_error = "", ""
    if os.environ.get("AWS_ENDPOINT_URL"):
        s3_url = f"s3://zerostall-bench/node-loss-{uuid.uuid4().hex[:8]}"
        try:
            _upload(os.path.join(base, "n1"), s3_url)
        except (ZerostallError, OSError) as exc:  # a shared server that is full or busy: say so, go on
            s3_url, s3_error = "", str(exc)
    out: dict[str, Any] = {
        "scenario": "node-loss", "date_utc": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "nodes": NODES, "state_bytes": state_bytes, "replicas": 2, "peer_bandwidth_bytes": cap,
        "bytes_moved_per_save": sum(d["bytes_sent"] for d in paced),
        "step_ms_idle": _ms(paced[0]["before"] + paced[0]["after"]),  # before the save and after protected
        "step_ms_saving_no_replicas": _ms(plain[0]["during"]),
        "step_ms_saving_replicating_paced": _ms(paced[0]["during"]),
        "step_ms_replicating_only_paced": _ms(paced[0]["replicating"]), "steps_replicating_only": len(paced[0]["replicating"]),
        "saved_s_no_replicas": max(d["t_done_s"] for d in plain), "replicated_s": max(d["t_done_s"] for d in paced),
        "protected": all(d["protected"] for d in paced), "rounds": [], "recover_bit_exact": True,
    }
    if s3_error:
        out["s3_error"] = s3_error
    # n1 wiped and the job restarted, its files from each tier in turn, ``rounds`` times in
    # alternation (the shared disk and the other sessions' load drift: one order would favour
    # whichever tier runs last); every node's files dropped from the page cache before each
    tiers = [("peers", ""), ("peers2h", "")] + [("sharedfs", f"file://{shared}")] + \
        ([("s3", s3_url)] if s3_url else [])
    for r in range(rounds):
        row: dict[str, Any] = {}
        for label, url in (tiers if r % 2 == 0 else tiers[::-1]):
            shutil.rmtree(os.path.join(base, "n1"), ignore_errors=True)
            _uncache(base)
            _uncache(shared)
            if label == "peers2h":
                shutil.rmtree(os.path.join(base3, "n1"), ignore_errors=True)
                _uncache(base3)
            rs = _run("load", base, work, mib, 2, cap, "") if label == "peers" else \
                _run("load", base3, work, mib, 3, cap, "") if label == "peers2h" else \
                _run("load_remote", base, work, mib, 1, 0, url)
            row[f"files_{label}_s"], row[f"recover_{label}_s"] = rs[1]["files_s"], rs[1]["load_s"]
            row[f"others_loaded_{label}_s"] = max(d["load_s"] for d in rs)
            if label.startswith("peers"):
                row[f"fetch_only_{label}_s"], row[f"recover_{label}_source"] = rs[1]["fetch_s"], rs[1]["source"]
            out["recover_bit_exact"] = out["recover_bit_exact"] and all(d["equal"] for d in rs)
        out["rounds"].append(row)
    for k in out["rounds"][0]:
        vals = [row[k] for row in out["rounds"]]
        out[k] = statistics.median(vals) if isinstance(vals[0], float) else vals[0]
    for label, _ in tiers[2:]:
        out[f"files_{label}_over_peers"] = [round(row[f"files_{label}_s"] / max(row["files_peers_s"], 1e-9), 2)
                                            for row in out["rounds"]]
        out[f"recover_{label}_over_peers"] = [round(row[f"recover_{label}_s"] / max(row["recover_peers_s"], 1e-9), 2)
                                              for row in out["rounds"]]
    if s3_url:
        from zerostall.store.tier import open_tier
        open_tier(s3_url).delete(1)
    return out


@contextlib.contextmanager
def workdir(a: argparse.Namespace, prefix: str) -> Iterator[str]:
    """``--dir`` (kept) or a new temporary directory under the current one (removed after)."""
    work = a.dir or tempfile.mkdtemp(prefix=prefix, dir=".")
    os.makedirs(work, exist_ok=True)
    try:
        yield os.path.abspath(work)
    finally:
        if a.dir is None:
            shutil.rmtree(work, ignore_errors=True)


def main(a: argparse.Namespace) -> int:
    with workdir(a, "zerostall-node-loss-") as work:
        res = run(a.size_gib, work, CAP_BYTES, rounds=a.repeat)
    per_node = res["state_bytes"] / NODES
    print(f"node-loss: {NODES} nodes, {res['state_bytes'] / 2**30:.2f} GiB of state, replicas=2, "
          f"peer cap {CAP_BYTES / 1e6:.0f} MB/s per node")
    print(f"  bytes moved per save        {res['bytes_moved_per_save'] / 2**30:.3f} GiB = "
          f"{res['bytes_moved_per_save'] / res['state_bytes']:.3f} x (replicas-1) x state")
    print(f"  durable without replicas    {res['saved_s_no_replicas']:.2f} s; protected (2 copies) after "
          f"{res['replicated_s']:.2f} s")
    print(f"  recovery of n1 ({per_node / 2**20:.0f} MiB) in the restarted job, every tier timed alike from the "
          "barrier all 4 nodes leave at once: files in (n1's files committed in its root) / loaded (n1's "
          "collective Checkpointer.load returned, every byte verified; the 3 others load their own files in it); "
          f"median of {len(res['rounds'])} rounds in alternating order, each after the page cache was dropped:")
    for label, key in [("peers", "peers"), ("peers, N=3", "peers2h"), ("shared fs", "sharedfs"), ("S3", "s3")]:
        if f"recover_{key}_s" in res:
            each = ", ".join(f"{row[f'files_{key}_s']:.2f}/{row[f'recover_{key}_s']:.2f}" for row in res["rounds"])
            print(f"    {label:10s} {res[f'files_{key}_s']:.2f} / {res[f'recover_{key}_s']:.2f} s   (load after files "
                  f"in {res[f'recover_{key}_s'] - res[f'files_{key}_s']:.2f} s; rounds {each})")
    if "recover_s3_s" in res:
        print(f"    S3 / peers, per round: files in {res['files_s3_over_peers']}, loaded {res['recover_s3_over_peers']}")
    else:
        print(f"    S3 skipped ({res.get('s3_error') or 'no AWS_ENDPOINT_URL'})")
    print("  (peers, N=3: the same job saved with replicas=3, n1's file cut in two ranges fetched from its two "
          "holders at once)")
    print(f"  n1's peer fetch alone {res['fetch_only_peers_s']:.2f} s (the rest of files in: listing the holders, "
          f"the ranks' agreement, the commit); all bit-exact: {res['recover_bit_exact']}")
    idle = res["step_ms_idle"] or 1.0
    print(f"  rank 0 step time: idle {res['step_ms_idle']:.2f} ms, saving without replicas "
          f"{res['step_ms_saving_no_replicas']:.2f} ms, saving + paced replication "
          f"{res['step_ms_saving_replicating_paced']:.2f} ms "
          f"({res['step_ms_saving_replicating_paced'] / idle:.2f}x idle); between durable and protected (only the paced "
          f"copies run) {res['step_ms_replicating_only_paced']:.2f} ms over {res['steps_replicating_only']} steps "
          f"({res['step_ms_replicating_only_paced'] / idle:.2f}x idle)")
    write_doc(res, a.json)
    return 0
