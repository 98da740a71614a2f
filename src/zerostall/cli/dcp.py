"""``zerostall ls/verify/inspect`` on DCP checkpoints (zerostall.dcp or FileSystemWriter): a
local directory :func:`is_dcp_dir` accepts (app.py hands it over), or a root of ``step-N`` ones
(torchtitan's layout; ``--step N`` picks one). Exit status as in app.py.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys

from ..errors import CheckpointNotFound, ZerostallError
from .._term import safe
from .._util import human_bytes as _human
from ..config import IOConfig
from .commands import say, verdict

_STEP_DIR_RE = re.compile(r"^step-(\d{1,19})$")
_RANK_MD_RE = re.compile(r"^__(\d+)\.metadata$")


def metadata_files(path: str) -> list[str]:
    """The DCP metadata files of the directory ``path``: the global ``.metadata``, else one
    per rank (``__R.metadata``, in rank order), else [] (not a DCP checkpoint directory)."""
    try:
        names = os.listdir(path)
    except OSError:
        return []
    if ".metadata" in names:
        return [".metadata"]
    return sorted((n for n in names if _RANK_MD_RE.match(n)), key=lambda n: int(_RANK_MD_RE.match(n).group(1)))


def _step_dirs(root: str) -> list[tuple[int, str]]:
    """(step, dir) of the DCP checkpoints directly under ``root``, ascending; [] if ``root``
    holds a zerostall Checkpointer step (``manifest.json``)."""
    try:
        names = os.listdir(root)
    except OSError:
        return []
    out = []
    for n in names:
        m = _STEP_DIR_RE.match(n)
        d = os.path.join(root, n)
        if m and not os.path.islink(d):
            if os.path.lexists(os.path.join(d, "manifest.json")):
                return []
            if metadata_files(d):
                out.append((int(m.group(1)), d))
    return sorted(out)


def is_dcp_dir(path: str) -> bool:
    """A DCP checkpoint directory, or a root of ``step-N`` ones; by its files (imports no torch)."""
    return bool(metadata_files(path) or _step_dirs(path))


def _targets(a: argparse.Namespace) -> list[tuple[str, str]]:
    """(label, checkpoint dir) to act on."""
    if metadata_files(a.path):
        return [(a.path, a.path)]
    steps = _step_dirs(a.path)
    if getattr(a, "step", None) is not None:
        steps = [(s, d) for s, d in steps if s == a.step]
        if not steps:
            raise CheckpointNotFound(f"no DCP checkpoint step-{a.step} in {a.path}")
    return [(f"step {s}", d) for s, d in steps]


def cmd_ls(a: argparse.Namespace) -> int:
    from ..integrations.dcp_reader import describe
    rows = []
    for label, d in _targets(a):
        for name in metadata_files(d):
            try:
                i = describe(d, name)
                rows.append({"checkpoint": label, "metadata": name, "format": i.kind_name, "bytes": i.total_bytes,
                             "entries": len(i.entries), "files": len(i.files), "save_id": i.save_id,
                             "state": "committed"})
            except ZerostallError as exc:
                rows.append({"checkpoint": label, "metadata": name, "format": "?", "bytes": 0, "entries": 0,
                             "files": 0, "save_id": "", "state": f"invalid: {exc}"})
    if a.json:
        print(json.dumps(rows, indent=1))
        return 0
    print(f"DCP checkpoints in {safe(a.path)}")
    for r in rows:
        print(f"  {safe(r['checkpoint'])}: {safe(r['metadata'])}: {r['format']}, {r['entries']} entries, "
              f"{_human(r['bytes'])} in {r['files']} file(s), {safe(r['state'])}")
    return 0


def cmd_verify(a: argparse.Namespace) -> int:
    from ..integrations.dcp_reader import verify
    rows = []
    for label, d in _targets(a):
        for name in metadata_files(d):
            try:
                i = verify(d, name, IOConfig(engine=a.engine))
                how = "verified" if i.kind == "zerostall" else "loaded (FileSystemWriter stores no checksums)"
                rows.append({"checkpoint": label, "metadata": name, "state": "ok", "format": i.kind_name,
                             "entries": len(i.entries), "bytes": i.total_bytes, "checksums": i.kind == "zerostall"})
                say(a, f"{safe(label)}: {safe(name)}: OK ({i.kind_name}, {len(i.entries)} entries, "
                       f"{_human(i.total_bytes)} {how})")
            except ZerostallError as exc:
                rows.append({"checkpoint": label, "metadata": name, "state": "failed", "error": str(exc)})
                print(f"{safe(label)}: {safe(name)}: FAILED: {safe(exc)}", file=sys.stderr)
    return verdict(a, rows)


def cmd_inspect(a: argparse.Namespace) -> int:
    from ..integrations.dcp_reader import describe
    targets = _targets(a)[-1:]  # a root: the newest step (or --step)
    infos = [describe(d, n) for _, d in targets for n in metadata_files(d)]
    if a.json:
        print(json.dumps([{"metadata": i.metadata, "format": i.kind_name, "bytes": i.total_bytes,
                           "files": i.files, "entries": i.entries} for i in infos], indent=1))
        return 0
    for i in infos:
        print(f"{safe(i.metadata)}: {i.kind_name}, {len(i.entries)} entries, {_human(i.total_bytes)}")
        for e in i.entries:
            shape = "" if e["type"] == "object" else f" {e['shape']}"
            print(f"  {safe(repr(e['key']))}: {e['type']} {e['dtype']}{shape}, {e['chunks']} chunk(s)")
    return 0
