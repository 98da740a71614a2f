"""``zerostall ls/verify/inspect`` on a DCP checkpoint directory (zerostall.dcp or FileSystemWriter).

cli.py hands a local directory holding DCP metadata (``.metadata`` or ``__R.metadata``) to
these; everything else stays in cli.py. Exit status as there: 0 fine, 1 a check failed.
"""

from __future__ import annotations

import argparse
import json
import sys

from .errors import ZerostallError


def is_dcp_dir(path: str) -> bool:
    from .dist.dcp_inspect import is_dcp_dir as _is
    return _is(path)


def _human(n: float) -> str:
    from .cli import _human as h
    return h(n)


def cmd_ls(a: argparse.Namespace) -> int:
    from .dist.dcp_inspect import describe, metadata_files
    rows = []
    for name in metadata_files(a.path):
        try:
            i = describe(a.path, name)
            rows.append({"metadata": name, "format": i.kind_name, "bytes": i.total_bytes, "entries": len(i.entries),
                         "files": len(i.files), "save_id": i.save_id, "state": "committed"})
        except ZerostallError as exc:
            rows.append({"metadata": name, "format": "?", "bytes": 0, "entries": 0, "files": 0, "save_id": "",
                         "state": f"invalid: {exc}"})
    if a.json:
        print(json.dumps(rows, indent=1))
        return 0
    print(f"DCP checkpoint in {a.path}")
    for r in rows:
        print(f"  {r['metadata']}: {r['format']}, {r['entries']} entries, {_human(r['bytes'])} in {r['files']} "
              f"file(s), {r['state']}")
    return 0


def cmd_verify(a: argparse.Namespace) -> int:
    from .config import IOConfig
    from .dist.dcp_inspect import metadata_files, verify
    bad = 0
    for name in metadata_files(a.path):
        try:
            i = verify(a.path, name, IOConfig(engine=a.engine))
            how = "verified" if i.kind == "zerostall" else "loaded (FileSystemWriter stores no checksums)"
            print(f"{name}: OK ({i.kind_name}, {len(i.entries)} entries, {_human(i.total_bytes)} {how})")
        except ZerostallError as exc:
            bad += 1
            print(f"{name}: FAILED: {exc}", file=sys.stderr)
    return 1 if bad else 0


def cmd_inspect(a: argparse.Namespace) -> int:
    from .dist.dcp_inspect import describe, metadata_files
    infos = [describe(a.path, n) for n in metadata_files(a.path)]
    if a.json:
        print(json.dumps([{"metadata": i.metadata, "format": i.kind_name, "bytes": i.total_bytes,
                           "files": i.files, "entries": i.entries} for i in infos], indent=1))
        return 0
    for i in infos:
        print(f"{i.metadata}: {i.kind_name}, {len(i.entries)} entries, {_human(i.total_bytes)}")
        for e in i.entries:
            shape = "" if e["type"] == "object" else f" {e['shape']}"
            print(f"  {e['key']!r}: {e['type']} {e['dtype']}{shape}, {e['chunks']} chunk(s)")
    return 0
