"""The ``zerostall`` command line. Each subcommand is a thin shell over the library.

Exit status: 0 success; 1 a failure, with one line on stderr naming the cause; 2 bad usage
(argparse, invalid options, a checkpoint root that does not exist; an existing root without
checkpoints prints "no checkpoints"). Read-only commands (``ls``, ``verify``, ``inspect``,
``export``'s source, ``doctor``) create nothing. What comes from a checkpoint is printed
literally (:func:`zerostall._term.safe`): no rich markup, control characters as escapes. The
commands that read or write tensors (verify, restore, export, demo) import torch when they run,
never for ``--help``, ``plan``, ``ls``, ``inspect`` or ``doctor`` (docs/cli-startup.md).
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import json
import logging
import os
import sys
from typing import Any, Callable

from . import dcp as cli_dcp
from .._term import console as _console, safe, table
from .._util import human_bytes as _human
from ..errors import CheckpointNotFound, ConfigError, CorruptCheckpoint, RemoteError, RootNotFound, ZerostallError
from ..store import open_root
from ..store.tier import is_url, open_tier
from ..peers.status import peer_rows, quota_lines
from . import commands as cli_cmd
from .commands import _engine, _tier


def _rows(tier: Any, label: str) -> list[dict[str, Any]]:
    """``ls`` rows of one tier: its steps (damaged ones too), then its partial steps."""
    rows = []
    for s in tier.listed_steps():
        try:
            m = tier.read_manifest(s)
            rows.append({"step": s, "bytes": m.total_bytes, "tensors": len(m.tensors),
                         "created_unix": m.created_unix, "state": "committed", "tier": label,
                         # bytes the step owns (its files) vs borrows from earlier steps (incremental saves)
                         "bytes_owned": m.total_bytes, "bytes_referenced": m.referenced_bytes,
                         "references_steps": sorted({r.step for r in m.ref_files})})
        except ZerostallError as exc:
            rows.append({"step": s, "bytes": 0, "tensors": 0, "created_unix": 0,
                         "state": f"invalid manifest: {exc}", "tier": label})
    for s in tier.partial_steps():
        rows.append({"step": s, "bytes": 0, "tensors": 0, "created_unix": 0,
                     "state": "partial (not a checkpoint)", "tier": label})
    return rows


def cmd_ls(a: argparse.Namespace) -> int:
    if not is_url(a.path) and cli_dcp.is_dcp_dir(a.path):  # a DCP checkpoint directory
        return cli_dcp.cmd_ls(a)
    tier = _tier(a.path)
    title = a.path if is_url(a.path) else tier.root
    rows = _rows(tier, "remote" if is_url(a.path) else "local")
    if not is_url(a.path):  # peer replicas: this node's steps' holders, the copies it keeps for others
        peer_rows(tier.root, rows)
    if a.remote and not is_url(a.path):
        try:
            remote_rows = {r["step"]: r for r in _rows(_tier(a.remote), "remote")}
        except (RemoteError, RootNotFound) as exc:  # the local listing is still worth showing
            print(f"zerostall ls: cannot list {a.remote}: {exc}", file=sys.stderr)
        else:
            for r in rows:
                if r["state"] == "committed":
                    r["tier"] = "local+remote" if remote_rows.pop(r["step"], None) else "local (not replicated)"
            rows.extend(remote_rows.values())
    if a.json:
        print(json.dumps(rows, indent=1))
        return 0
    if not rows:
        print(f"no checkpoints in {safe(title)}")
        return 0
    import datetime as dt
    t = table(f"checkpoints in {title}", ("step", "size", "referenced", "tensors", "created", "tier", "state"),
              right=("step", "size", "referenced", "tensors"))
    for r in sorted(rows, key=lambda r: r["step"]):
        created = dt.datetime.fromtimestamp(r["created_unix"]).isoformat(" ", "seconds") if r["created_unix"] else ""
        ref = (f"{_human(r['bytes_referenced'])} in {','.join(map(str, r['references_steps']))}"
               if r.get("bytes_referenced") else "")
        t.add_row(str(r["step"]), _human(r["bytes"]), ref, str(r["tensors"]), created, safe(r["tier"]),
                  safe(r["state"]))
    _console().print(t)
    if not is_url(a.path):
        for line in quota_lines(tier.root):
            print(safe(line))
    return 0


def _verify(a: argparse.Namespace) -> int:
    from .verify import cmd_verify  # torch, as the other commands that read tensors
    return cmd_verify(a)


def cmd_restore(a: argparse.Namespace) -> int:
    from ..restore.download import restore_remote  # torch
    remote = open_tier(a.url)  # a plain path too: a shared-filesystem tier
    remote.check_root()
    if a.step is None and not remote.steps():
        raise CheckpointNotFound(f"no committed checkpoint at {a.url}")
    tier = open_root(a.to, create=True)
    tier.own()  # a writer of --to: refused (naming the owner) while a training run holds it
    engine = _engine("auto", tier.root)
    try:
        m = restore_remote(tier, remote, engine, a.step,
                           on_failure=lambda s, why: print(f"step {s}: FAILED verification: {safe(why)}",
                                                           file=sys.stderr))
    except CorruptCheckpoint:
        return 1  # each step's failure is printed above
    finally:
        engine.close()
        tier.release()
    print(f"restored step {m.step} from {safe(a.url)} into {safe(tier.step_dir(m.step))} "
          f"({_human(m.total_bytes)}, verified)")
    return 0


def _manifest(tier: Any, step: int | None) -> Any:
    """The manifest of ``step`` (``--step``), else of the newest committed step."""
    step = step if step is not None else tier.latest()
    if step is None:
        raise CheckpointNotFound(f"no committed checkpoint in {tier.url}")
    return tier.read_manifest(step)


def cmd_inspect(a: argparse.Namespace) -> int:
    if cli_dcp.is_dcp_dir(a.path):  # a DCP checkpoint directory
        return cli_dcp.cmd_inspect(a)
    m = _manifest(_tier(a.path), a.step)
    if a.json:
        print(json.dumps(m.body(objects=True), indent=1))
        return 0
    refs = f" + {_human(m.referenced_bytes)} referenced" if m.ref_files else ""
    t = table(f"step {m.step}: {len(m.tensors)} tensors, {_human(m.total_bytes)} owned{refs}, "
              f"world size {m.world_size}",
              ("key", "dtype", "shape", "bytes", "file", "offset", "crc32c"))
    for e in m.tensors:
        where = e.file if e.step is None else f"step-{e.step}/{e.file}"
        t.add_row(safe(e.key), e.dtype, str(list(e.shape)), _human(e.nbytes), safe(where), str(e.offset),
                  f"{e.crc32c:08x}")
    _console().print(t)
    return 0


EXPORT_FORMATS = ("safetensors", "lightning", "transformers", "accelerate")


def cmd_export(a: argparse.Namespace) -> int:
    if a.format not in EXPORT_FORMATS:
        raise ConfigError(f"unknown export format {a.format!r} (supported: {', '.join(EXPORT_FORMATS)})")
    if importlib.util.find_spec("safetensors") is None:  # checked before the checkpoint is read
        raise ConfigError("export needs the safetensors package: pip install 'zerostall[safetensors]'")
    import tempfile

    from ..integrations import export  # torch
    from ..restore import LoadReport, LoadRequest, load
    out_dir = os.path.dirname(os.path.abspath(a.out))
    if not os.path.isdir(out_dir) or not os.access(out_dir, os.W_OK):
        raise ConfigError(f"cannot write {a.out!r}: {out_dir!r} is not a writable directory")
    report = LoadReport()
    with tempfile.TemporaryDirectory(prefix="zerostall-export-") as scratch:
        src, remote = (scratch, a.path) if is_url(a.path) else (a.path, None)
        rank, world = _export_rank(a, remote)
        state = load(src, None, LoadRequest(step=a.step, remote=remote, rank=rank, world_size=world), report=report)
    if a.format != "safetensors":  # the files the framework's own checkpointing reads
        files = export.write(a.format, state, a.out, rank=rank, world_size=world)
        print(f"wrote step {report.step} as a {a.format} checkpoint: {safe(a.out)} ({', '.join(map(safe, files))})")
        return 0
    flat = export.flatten(state)
    if a.prefix:
        strip = a.prefix.rstrip(".") + "."
        flat = {k[len(strip):]: v for k, v in flat.items() if k.startswith(strip)}
        if not flat:
            raise ConfigError(f"no tensor key of step {report.step} starts with {strip!r} "
                              f"(top-level keys: {sorted(state)[:20] if isinstance(state, dict) else []})")
    export.save_safetensors(flat, a.out, {"zerostall_step": str(report.step), "source": a.path,
                                          **({"zerostall_rank": str(rank)} if world > 1 else {})})
    print(f"wrote {len(flat)} tensors of step {report.step} to {safe(a.out)}")
    return 0


def _export_rank(a: argparse.Namespace, remote: str | None) -> tuple[int, int]:
    """(rank, world size) to export: a checkpoint saved per rank needs ``--rank``."""
    m = _manifest(_tier(remote or a.path), a.step)
    if m.rank_trees is None:
        if a.rank not in (None, 0):
            raise ConfigError(f"step {m.step} holds one state for all ranks; --rank {a.rank} does not apply")
        return 0, 1
    if a.rank is None or not 0 <= a.rank < m.world_size:
        raise ConfigError(f"step {m.step} was saved per rank by {m.world_size} ranks: "
                          f"pass --rank 0..{m.world_size - 1}")
    return a.rank, m.world_size


BENCH_HINT = ("the benchmark lives in the zerostall-bench package, which is not installed here: "
              "from a zerostall checkout, pip install -e ./bench (make test and make bench install it)")


def _checked(kind: Callable[[str], Any], ok: Callable[[Any], bool], what: str) -> Callable[[str], Any]:
    """An argparse type: ``kind(text)`` if ``ok`` holds for it, else a usage error saying it is not ``what``."""
    def parse(text: str) -> Any:
        try:
            value = kind(text)
        except ValueError:
            value = None
        if value is None or not ok(value):
            raise argparse.ArgumentTypeError(f"{text} is not {what}")
        return value
    return parse


def _positive(kind: Callable[[str], Any]) -> Callable[[str], Any]:
    """An argparse type: a number > 0 (the bench's options use it too)."""
    return _checked(kind, lambda v: v > 0, "a number > 0")


def bench_installed() -> bool:
    """Whether the zerostall_bench package can be imported (a seam for the test of the hint)."""
    return importlib.util.find_spec("zerostall_bench") is not None


def _bench_missing(a: argparse.Namespace) -> int:
    print(f"zerostall bench: {BENCH_HINT}", file=sys.stderr)
    return 1


def _arg(*flags: str, **kw: Any) -> tuple[tuple[str, ...], dict[str, Any]]:
    return flags, kw


def _flag(name: str, help: str) -> tuple[tuple[str, ...], dict[str, Any]]:
    return (name,), {"action": "store_true", "help": help}


PATH = "a local directory, s3://bucket/prefix or file:///path"
COMMANDS: dict[str, tuple[str, Any, list[tuple[tuple[str, ...], dict[str, Any]]]]] = {
    "ls": ("list checkpoints (steps, sizes, state) of a directory or a remote URL", cmd_ls, [
        _arg("path", help=PATH),
        _arg("--remote", help="also show which steps this remote tier (URL) holds"),
        _flag("--json", "print the rows as JSON")]),
    "restore": ("download the newest verified checkpoint (or --step) from a remote tier", cmd_restore, [
        _arg("url", help="the remote tier: s3://bucket/prefix or file:///path"),
        _arg("--to", required=True, help="local checkpoint directory (created if needed)"),
        _arg("--step", type=int, help="this step instead of the newest that verifies")]),
    "verify": ("read and check every byte; exit 1 naming the file and tensor on failure", _verify, [
        _arg("path", help=f"{PATH} (streamed, not stored)"),
        _arg("--step", type=int, help="only this step (default: every step)"),
        _arg("--engine", default="auto", choices=("auto", "uring", "threads", "buffered"),
             help="I/O engine to read with (default: chosen by probing the directory)"),
        _arg("--node", help="this node's name, for a node-local copy (default: ZEROSTALL_NODE, "
                            "else the host name): shards written on other nodes live in their copies"),
        _flag("--all-files", "require every rank's shard in this root (a shared root), not only this copy's"),
        _flag("--json", "print one JSON object per step (state ok/failed/deleted) instead of lines")]),
    "inspect": ("tensors, dtypes, shapes, bytes of a checkpoint", cmd_inspect, [
        _arg("path", help=PATH),
        _arg("--step", type=int, help="this step (default: the newest)"),
        _flag("--json", "print the whole manifest body as JSON (one object per tensor)")]),
    "export": ("write a checkpoint's tensors to another format", cmd_export, [
        _arg("path", help=PATH),
        _arg("--step", type=int, default=None, help="this step (default: the newest that verifies)"),
        _arg("--rank", type=int, default=None, help="the rank whose state to export, for a checkpoint saved per rank"),
        _arg("--prefix", default="", help="export only keys under this prefix, without it (e.g. --prefix model, so "
                                          "that model.load_state_dict(load_file(OUT)) works)"),
        _arg("--format", default="safetensors",
             help="safetensors (the tensors, flattened), or what a framework's own checkpointing reads: lightning "
                  "(a .ckpt file), transformers (a checkpoint-N folder), accelerate (a save_state folder)"),
        _arg("out", help="output file (a folder for transformers/accelerate)")]),
    "delete": ("delete steps for good: from each root given and from the copies it holds for peers (a tombstone "
               "keeps them from coming back from other holders)", cli_cmd.cmd_delete, [
        _arg("roots", nargs="+", metavar="ROOT", help="a local checkpoint directory (one per node)"),
        _arg("--step", type=_checked(int, lambda v: v >= 0, "a step number (an integer >= 0)"), action="append",
             required=True, help="the step to delete (repeat for more)")]),
    "demo": ("train a small transformer with async checkpoints, crash it, resume bit-exact",
             lambda a: importlib.import_module("zerostall.demo.run").main(a), [
        _arg("--steps", type=_positive(int), default=60, help="training steps"),
        _arg("--every", type=_positive(int), default=10, help="checkpoint interval in steps"),
        _arg("--dir", default=None, help="checkpoint directory (default: a temp dir, removed)"),
        _flag("--keep", "keep the checkpoint directory"),
        _arg("--seed", type=int, default=0, help="random seed of the model and data"),
        _flag("--tiny", "a tiny model (used by the tests)")]),
    "bench": ("zerostall vs torch.save vs DCP on the same disk, with a training loop running", None, []),
    "doctor": ("check this host and a checkpoint directory; advise sysctls", cli_cmd.cmd_doctor, [
        _arg("path", nargs="?", default=".", help="checkpoint directory to check (not created; default .)"),
        _flag("--json", "print the checks as JSON"),
        _flag("--probe", "measure the direct-I/O line rate (512 MiB)"),
        _arg("--write-sysctl", metavar="FILE", help="write the recommendations as a sysctl.d file"),
        _flag("--apply", "apply the recommendations now (root); prints how to revert")]),
    "plan": ("size checkpoints: volume, bandwidth, stall, RAM", cli_cmd.cmd_plan, [
        _arg("--params", help="parameter count, e.g. 70e9 or 175B"),
        _arg("--bytes-per-param", type=float, default=14.0,
             help="checkpoint bytes per parameter (14: mixed precision + AdamW)"),
        _arg("--checkpoint-bytes", help="the checkpoint size directly, e.g. 2.4T"),
        _arg("--ranks", type=int, default=1, help="ranks writing in parallel"),
        _arg("--nodes", type=int, default=1, help="nodes (each with its own NIC)"),
        _arg("--interval-min", type=float, default=30.0, help="minutes between checkpoints"),
        _arg("--budget-s", type=float, help="time a checkpoint may take, seconds"),
        _arg("--fs-gbps", type=float, help="storage aggregate write rate, GB/s"),
        _arg("--nic-gbps", help="NIC bandwidth per node in Gbit/s, e.g. 200 or 2x100"),
        _arg("--node-ram-gib", type=float, help="RAM per node, GiB (does the staging arena fit?)"),
        _flag("--json", "print the plan as JSON")]),
    "monitor": ("nr_dirty, writeback, PSI, kswapd (and a process's state), live", cli_cmd.cmd_monitor, [
        _arg("--pid", type=int, help="also show this process's state (D = blocked on I/O)"),
        _flag("--once", "print one sample and exit"),
        _flag("--json", "print samples as JSON lines"),
        _arg("--interval-s", type=float, default=0.5, help="seconds between samples")]),
    "trace": ("latency of writers throttled in balance_dirty_pages", cli_cmd.cmd_trace, [
        _arg("--seconds", type=float, default=10.0, help="how long to trace"),
        _arg("--pid", type=int, help="fallback: sample this process's threads"),
        _flag("--json", "print the histogram as JSON"),
        _flag("--print-program", "print the bpftrace program and exit"),
        _flag("--no-bpftrace", "use the tracepoint or D-state sampling fallback")]),
}
"""Every subcommand, in ``--help`` order: its help, its function and its arguments."""


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="zerostall", description="Checkpoint PyTorch training without stalling it.")
    p.add_argument("-v", "--verbose", action="store_true", help="log at INFO level")
    sub = p.add_subparsers(dest="cmd", required=True)
    for name, (help_, fn, args) in COMMANDS.items():
        if name == "bench" and not bench_installed():
            # every word after "bench", options and --help included, is taken as an argument: any
            # invocation prints the hint (prefix_chars no argument starts with)
            s = sub.add_parser(name, help=f"{help_} (needs zerostall-bench)", add_help=False, prefix_chars="\0")
            s.add_argument("args", nargs="*")
            s.set_defaults(fn=_bench_missing)
            continue
        s = sub.add_parser(name, help=help_)
        if name == "bench":  # the zerostall_bench package: argparse only, no torch at parser build time
            from zerostall_bench import cli as bench_cli
            bench_cli.add_arguments(s)
            fn = bench_cli.run
        for flags, kw in args:
            s.add_argument(*flags, **kw)
        s.set_defaults(fn=fn)
    return p


def main(argv: list[str] | None = None) -> int:
    p = build_parser()
    a = p.parse_args(argv)  # usage errors: argparse prints one line and exits 2
    logging.basicConfig(level=logging.INFO if a.verbose else logging.WARNING, format="%(levelname)s %(message)s")

    def fail(exc: BaseException, code: int, what: str = "") -> int:
        msg = " ".join(safe(what or exc).split())
        print(f"zerostall {a.cmd}: {msg}", file=sys.stderr)
        return code

    try:
        return int(a.fn(a) or 0)
    except (ConfigError, RootNotFound) as exc:
        return fail(exc, 2)
    except ZerostallError as exc:
        return fail(exc, 1)
    except OSError as exc:  # e.g. an unwritable output path
        where = f" {exc.filename!r}" if getattr(exc, "filename", None) else ""
        return fail(exc, 1, f"{exc.strerror or exc}{':' if where else ''}{where}")
    except ImportError as exc:
        return fail(exc, 1, f"{exc} (a package this command needs is missing: pip install 'zerostall[all]')")
    except KeyboardInterrupt:
        return 130
    except Exception as exc:
        mod = type(exc).__module__ or ""
        if mod.split(".")[0] in ("botocore", "boto3", "s3transfer", "safetensors"):  # user errors from libraries
            return fail(exc, 1, f"{type(exc).__name__}: {exc}")
        raise

