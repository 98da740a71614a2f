"""The ``zerostall`` command line. Each subcommand is a thin shell over the library.

Exit status: 0 success, 1 a check failed (``verify``, ``demo``), 2 bad usage or input.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
from typing import Any, Callable

from . import cli_dcp
from .errors import CheckpointNotFound, CorruptCheckpoint, ZerostallError


def _human(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{int(n)} B"
        n /= 1024
    return f"{n:.1f} TiB"


def _engine(name: str, root: str) -> Any:
    from .config import IOConfig
    from .io import choose_engine
    return choose_engine(root, IOConfig(engine=name))


def _is_url(p: str) -> bool:
    return "://" in p


def _remote_rows(url: str) -> list[dict[str, Any]]:
    from .format.manifest import Manifest
    from .store.remote import open_tier
    remote = open_tier(url)
    rows = []
    for s in remote.steps():
        try:
            m = Manifest.from_bytes(remote.read_manifest_bytes(s), where=f"{url}/step-{s}")
            rows.append({"step": s, "bytes": m.total_bytes, "tensors": len(m.tensors),
                         "created_unix": m.created_unix, "state": "committed", "tier": "remote"})
        except ZerostallError as exc:
            rows.append({"step": s, "bytes": 0, "tensors": 0, "created_unix": 0,
                         "state": f"invalid manifest: {exc}", "tier": "remote"})
    return rows


def cmd_ls(a: argparse.Namespace) -> int:
    if not _is_url(a.path) and cli_dcp.is_dcp_dir(a.path):  # a DCP checkpoint directory
        return cli_dcp.cmd_ls(a)
    from rich.console import Console
    from rich.table import Table

    from .store.local import LocalTier
    rows = []
    if _is_url(a.path):
        rows = _remote_rows(a.path)
        title = a.path
    else:
        tier = LocalTier(a.path)
        title = tier.root
        for s in tier.listed_steps():  # damaged ones too, reported as such
            try:
                m = tier.read_manifest(s)
                rows.append({"step": s, "bytes": m.total_bytes, "tensors": len(m.tensors),
                             "created_unix": m.created_unix, "state": "committed", "tier": "local"})
            except ZerostallError as exc:
                rows.append({"step": s, "bytes": 0, "tensors": 0, "created_unix": 0,
                             "state": f"invalid manifest: {exc}", "tier": "local"})
        for s in tier.partial_steps():
            rows.append({"step": s, "bytes": 0, "tensors": 0, "created_unix": 0,
                         "state": "partial (not a checkpoint)", "tier": "local"})
        if a.remote:
            remote_rows = {r["step"]: r for r in _remote_rows(a.remote)}
            for r in rows:
                if r["step"] in remote_rows and r["state"] == "committed":
                    r["tier"] = "local+remote"
                    remote_rows.pop(r["step"])
                elif r["state"] == "committed":
                    r["tier"] = "local (not replicated)"
            rows.extend(remote_rows.values())
    if a.json:
        print(json.dumps(rows, indent=1))
        return 0
    if not rows:
        print(f"no checkpoints in {title}")
        return 0
    import datetime as dt
    t = Table(title=f"checkpoints in {title}")
    for col in ("step", "size", "tensors", "created", "tier", "state"):
        t.add_column(col, justify="right" if col in ("step", "size", "tensors") else "left")
    for r in sorted(rows, key=lambda r: r["step"]):
        created = dt.datetime.fromtimestamp(r["created_unix"]).isoformat(" ", "seconds") if r["created_unix"] else ""
        t.add_row(str(r["step"]), _human(r["bytes"]), str(r["tensors"]), created, r["tier"], r["state"])
    Console().print(t)
    return 0


def cmd_restore(a: argparse.Namespace) -> int:
    from .restore import fetch_remote_step, verify_step
    from .store.local import LocalTier
    from .store.remote import open_tier
    remote = open_tier(a.url)
    steps = remote.steps()
    if a.step is not None:
        if a.step not in steps:
            raise CheckpointNotFound(f"no committed step {a.step} at {a.url} (steps: {steps or 'none'})")
        steps = [a.step]
    if not steps:
        raise CheckpointNotFound(f"no committed checkpoint at {a.url}")
    tier = LocalTier(a.to, create=True)
    engine = _engine("auto", tier.root)
    try:
        for s in reversed(steps):
            try:
                fetch_remote_step(tier, remote, s)
                m = verify_step(tier, s, engine)
                print(f"restored step {s} from {a.url} into {tier.step_dir(s)} ({_human(m.total_bytes)}, verified)")
                return 0
            except CorruptCheckpoint as exc:
                print(f"step {s}: FAILED verification: {exc}", file=sys.stderr)
                tier.delete(s)
    finally:
        engine.close()
    return 1


def cmd_verify(a: argparse.Namespace) -> int:
    if cli_dcp.is_dcp_dir(a.path):  # a DCP checkpoint directory
        return cli_dcp.cmd_verify(a)
    from .restore import verify_step
    from .store.local import LocalTier
    tier = LocalTier(a.path)
    steps = [a.step] if a.step is not None else tier.listed_steps()
    if not steps:
        print(f"no committed checkpoint in {tier.root}", file=sys.stderr)
        return 1
    engine = _engine(a.engine, tier.root)
    bad = 0
    for s in steps:
        try:
            m = verify_step(tier, s, engine)
            print(f"step {s}: OK ({len(m.tensors)} tensors, {_human(m.total_bytes)} verified)")
        except (CorruptCheckpoint, CheckpointNotFound) as exc:
            bad += 1
            print(f"step {s}: FAILED: {exc}", file=sys.stderr)
    engine.close()
    return 1 if bad else 0


def cmd_inspect(a: argparse.Namespace) -> int:
    if cli_dcp.is_dcp_dir(a.path):  # a DCP checkpoint directory
        return cli_dcp.cmd_inspect(a)
    from rich.console import Console
    from rich.table import Table

    from .store.local import LocalTier
    tier = LocalTier(a.path)
    step = a.step if a.step is not None else tier.latest()
    if step is None:
        raise CheckpointNotFound(f"no committed checkpoint in {tier.root}")
    m = tier.read_manifest(step)
    if a.json:
        print(json.dumps(m.body(), indent=1))
        return 0
    t = Table(title=f"step {step}: {len(m.tensors)} tensors, {_human(m.total_bytes)}, world size {m.world_size}")
    for col in ("key", "dtype", "shape", "bytes", "file", "offset", "crc32c"):
        t.add_column(col)
    for e in m.tensors:
        t.add_row(e.key, e.dtype, str(list(e.shape)), _human(e.nbytes), e.file, str(e.offset), f"{e.crc32c:08x}")
    Console().print(t)
    return 0


def cmd_export(a: argparse.Namespace) -> int:
    if a.format != "safetensors":
        print(f"unknown export format {a.format!r} (supported: safetensors)", file=sys.stderr)
        return 2
    try:
        from safetensors.torch import save_file
    except ImportError:
        print("export needs the safetensors package: pip install 'zerostall[safetensors]'", file=sys.stderr)
        return 2
    import torch

    from .restore import load
    state = load(a.path, step=a.step)
    flat: dict[str, torch.Tensor] = {}

    def walk(x: Any, prefix: str) -> None:
        if isinstance(x, torch.Tensor):
            if prefix in flat:
                raise ZerostallError(f"key {prefix!r} appears twice after flattening; cannot export")
            flat[prefix] = x.contiguous()
        elif isinstance(x, dict):
            for k, v in x.items():
                walk(v, f"{prefix}.{k}" if prefix else str(k))
        elif isinstance(x, (list, tuple)):
            for i, v in enumerate(x):
                walk(v, f"{prefix}.{i}" if prefix else str(i))

    walk(state, "")
    # safetensors refuses shared storage; clone aliases (tied weights)
    seen: set[int] = set()
    for k, v in flat.items():
        if v.numel() and v.untyped_storage().data_ptr() in seen:
            flat[k] = v.clone()
        elif v.numel():
            seen.add(v.untyped_storage().data_ptr())
    save_file(flat, a.out, metadata={"zerostall_step": str(a.step), "source": os.path.abspath(a.path)})
    print(f"wrote {len(flat)} tensors to {a.out}")
    return 0


def _lazy(module: str, fn: str) -> Callable[[argparse.Namespace], int]:
    def run(a: argparse.Namespace) -> int:
        import importlib
        return getattr(importlib.import_module(module, __package__), fn)(a)
    return run


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="zerostall", description="Checkpoint PyTorch training without stalling it.")
    p.add_argument("-v", "--verbose", action="store_true", help="log at INFO level")
    sub = p.add_subparsers(dest="cmd", required=True)

    s = sub.add_parser("ls", help="list checkpoints (steps, sizes, state) of a directory or a remote URL")
    s.add_argument("path", help="a local directory, s3://bucket/prefix or file:///path")
    s.add_argument("--remote", help="also show which steps this remote tier holds")
    s.add_argument("--json", action="store_true")
    s.set_defaults(fn=cmd_ls)

    s = sub.add_parser("restore", help="download the newest verified checkpoint (or --step) from a remote tier")
    s.add_argument("url")
    s.add_argument("--to", required=True, help="local checkpoint directory")
    s.add_argument("--step", type=int)
    s.set_defaults(fn=cmd_restore)

    s = sub.add_parser("verify", help="read and check every byte; exit 1 naming the file and tensor on failure")
    s.add_argument("path")
    s.add_argument("--step", type=int)
    s.add_argument("--engine", default="auto")
    s.set_defaults(fn=cmd_verify)

    s = sub.add_parser("inspect", help="tensors, dtypes, shapes, bytes of a checkpoint")
    s.add_argument("path")
    s.add_argument("--step", type=int)
    s.add_argument("--json", action="store_true")
    s.set_defaults(fn=cmd_inspect)

    s = sub.add_parser("export", help="write a checkpoint's tensors to another format")
    s.add_argument("path")
    s.add_argument("--step", type=int, required=True)
    s.add_argument("--format", default="safetensors")
    s.add_argument("out")
    s.set_defaults(fn=cmd_export)

    from . import cli_host
    from .bench import cli as bench_cli
    bench_cli.add_parsers(sub)
    cli_host.add_parsers(sub)
    return p


def main(argv: list[str] | None = None) -> int:
    p = build_parser()
    a = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO if a.verbose else logging.WARNING,
                        format="%(levelname)s %(message)s")
    try:
        return int(a.fn(a) or 0)
    except ZerostallError as exc:
        print(f"zerostall {a.cmd}: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
