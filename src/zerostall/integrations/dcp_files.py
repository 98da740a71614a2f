"""Which files make a directory a DCP checkpoint (zerostall.dcp or FileSystemWriter): its
metadata file, global (``.metadata``) or one per rank (``__R.metadata``).

Names only: imports neither torch nor DCP, so that the CLI can tell a DCP directory from a
zerostall root without them. Caller's thread; reads a directory listing.
"""

from __future__ import annotations

import os
import re

METADATA = ".metadata"
_RANK_MD_RE = re.compile(r"^__(\d+)\.metadata$")


def metadata_files(path: str) -> list[str]:
    """The DCP metadata files of the directory ``path`` (global, or one per rank), or []."""
    try:
        names = os.listdir(path)
    except OSError:
        return []
    if METADATA in names:
        return [METADATA]
    return sorted((n for n in names if _RANK_MD_RE.match(n)), key=lambda n: int(_RANK_MD_RE.match(n).group(1)))


def is_dcp_dir(path: str) -> bool:
    return os.path.isdir(path) and bool(metadata_files(path))
