"""``zerostall bench``: its options and the scenario each one runs (imported only when run)."""

from __future__ import annotations

import argparse
import importlib

from zerostall.cli.app import _positive

SCENARIOS = {"default": "bench", "frozen-base": "frozen", "node-loss": "nodeloss", "node-loss-links": "nodeloss_links",
             "node-loss-coded": "nodeloss_coded", "replication-cost": "nodeloss_cost", "restore": "restore",
             "many-tensors": "many", "objects": "objects", "every-step": "everystep"}


def _device(text: str) -> str:
    if text not in ("cpu", "cuda"):
        raise argparse.ArgumentTypeError(f"{text!r}: use cpu or cuda")
    if text == "cuda":
        import torch
        if not torch.cuda.is_available():
            raise argparse.ArgumentTypeError("cuda: no CUDA device is available on this host")
    return text


def add_arguments(s: argparse.ArgumentParser) -> None:
    """The options of ``zerostall bench``; the library's CLI (zerostall/cli/app.py) calls
    this when it builds its parser, then runs :func:`run` with the parsed namespace."""
    s.add_argument("--size-gib", type=_positive(float), default=2.0, help="checkpoint size to save, GiB")
    s.add_argument("--repeat", type=_positive(int), default=3, help="saves per method")
    s.add_argument("--methods", default=None, help="comma-separated (default: all available)")
    s.add_argument("--dir", default=None, help="work directory on the disk to test (default: ./zerostall-bench-*)")
    s.add_argument("--device", type=_device, default="cpu", help="cpu or cuda: where the state lives")
    s.add_argument("--throttle-write-mbps", type=_positive(int), default=None,
                   help="cap the device's write bandwidth (cgroup) to emulate slow storage")
    s.add_argument("--json", default=None, help="write the results document here")
    s.add_argument("--plot", default=None, help="write a PNG: step latency and nr_dirty over time")
    s.add_argument("--settle-s", type=_positive(float), default=1.0, help="trainer warm-up before each save")
    s.add_argument("--no-line-rate", action="store_true", help="skip the fio/probe line-rate measurement")
    s.add_argument("--no-cold", action="store_true", help="skip the cold scenario (a fresh process per method)")
    s.add_argument("--tensors", type=_positive(int), default=100_000,
                   help="many-tensors scenario: how many tensors (--size-gib defaults to 0.25 there)")
    s.add_argument("--config-mib", type=_positive(float), default=16.0, help="objects scenario: config tree size, MiB of JSON")
    s.add_argument("--log-entries", type=_positive(int), default=10_000, help="objects scenario: log history entries")
    s.add_argument("--scenario", choices=tuple(SCENARIOS),
                   default="default",
                   help="frozen-base: incremental vs full zerostall saves vs torch.save vs DCP of a fine-tune "
                        "whose base is frozen (uses --size-gib, --repeat, --methods, --dir, --json); "
                        "node-loss: 4 simulated nodes with peer replicas, a node wiped and recovered from "
                        "peers vs the shared-fs and S3 tiers, --repeat rounds in alternating order (uses --size-gib (total), --repeat, --dir, --json); "
                        "node-loss-links: node-loss on a cluster of network namespaces, each node behind a "
                        "link of --link-mbit (each rate in turn), S3 (radosgw) behind --s3-mbit: recovery time "
                        "and fraction of the physical limit per tier, and a bare TCP stream's rate (root and a source checkout: tests/cluster; uses --size-gib "
                        "(total), --repeat, --dir, --json); "
                        "node-loss-coded: replicas=3 vs an RS(4,2) code on 7 nodes (the namespace cluster "
                        "harness when it runs here): bytes moved, encode CPU, the trainer's step time, a wiped "
                        "node's recovery (uses --size-gib (total), --repeat, --dir, --json); "
                        "replication-cost: node-loss's save phase per peers.cpu_priority (normal, nice, idle), "
                        "alternated --repeat rounds: the trainer's step time while only the paced copies run; "
                        "restore: restore GB/s of zerostall (in place, new dict; both engines), dcp.load, "
                        "torch.load and torch.load(mmap=True) against the read line rate (uses --size-gib, "
                        "--repeat, --dir, --json, --device: cuda restores into GPU tensors); many-tensors: --tensors small tensors vs torch.save and DCP "
                        "(stall, first save, durable, result() with keep_last=1, bytes on disk and staging, "
                        "restore); objects: a --config-mib config tree, a --log-entries log history and both "
                        "with tensors: save() stall and durable vs torch.save and json.dumps (uses --repeat, --dir, --json); "
                        "every-step: an in-process trainer checkpointing every step (block, skip), every --every "
                        "steps and with dcp.async_save, on all cores and all but one, and the CPU per GiB saved "
                        "against one copy + one crc32c pass (uses --size-gib (default 0.25), --seconds, --repeat, "
                        "--methods, --dir, --json)")
    s.add_argument("--seconds", type=_positive(float), default=6.0, help="every-step: seconds per mode")
    s.add_argument("--every", type=_positive(int), default=10, help="every-step: the interval of zs-every-K")
    s.add_argument("--spare-core-only", action="store_true",
                   help="every-step: run the trainer only on all cores but one (not on all cores too)")
    s.add_argument("--link-mbit", type=_positive(float), nargs="+", default=[4000.0, 1600.0],
                   help="node-loss-links: each node's link, megabits/s (several: each in turn)")
    s.add_argument("--s3-mbit", type=float, default=1000.0, help="node-loss-links: the S3 server's link (0: no S3)")


def run(a: argparse.Namespace) -> int:
    """Run the scenario ``a.scenario`` (its module's ``main(a)``), on the caller's thread."""
    return int(importlib.import_module(f"zerostall_bench.{SCENARIOS[a.scenario]}").main(a) or 0)
