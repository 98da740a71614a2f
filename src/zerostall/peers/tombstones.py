"""Steps deleted for good: ``peers/.deleted.json`` in a node's root, and the deletion itself.

``zerostall delete ROOT --step N`` (:func:`delete_step`, the job stopped) records a *tombstone*
(the checkpoint ids removed, the time), then removes the node's ``step-N`` and the copies of step
N it holds. A copy is dead if its id is recorded or its manifest is older than the deletion. At
start-up every node's leader publishes its tombstones (:mod:`.exchange`), merges the others' and
drops the dead copies it holds; a restore never counts a dead copy.
"""

from __future__ import annotations

import contextlib
import logging
import os
import time
from typing import Any

from ..errors import ZerostallError
from ..format.manifest import MANIFEST_NAME, Manifest
from ..store.local import LocalTier
from .status import drop_dir, held_dirs, read_json, write_json

log = logging.getLogger("zerostall")
NAME = ".deleted.json"

Tombs = dict[int, dict[str, Any]]
"""step -> {"ids": [checkpoint ids removed], "before": unix time of the deletion}"""


def path(root: str) -> str:
    return os.path.join(root, "peers", NAME)


def read(root: str) -> Tombs:
    """This root's tombstones ({} if none or unreadable: a damaged file deletes nothing)."""
    return parse(read_json(path(root)))


def parse(doc: Any) -> Tombs:
    """Tombstones from JSON (a file's or a peer's); malformed entries are skipped."""
    out: Tombs = {}
    if not isinstance(doc, dict):
        return out
    for k, v in doc.items():
        if not (isinstance(k, str) and k.isdigit() and isinstance(v, dict)):
            continue
        ids = [i for i in v.get("ids", ()) if isinstance(i, str)] if isinstance(v.get("ids"), list) else []
        before = v.get("before")
        out[int(k)] = {"ids": sorted(set(ids)), "before": float(before) if isinstance(before, (int, float)) else 0.0}
    return out


def merge(a: Tombs, b: Tombs) -> Tombs:
    out = {s: dict(v) for s, v in a.items()}
    for s, v in b.items():
        cur = out.setdefault(s, {"ids": [], "before": 0.0})
        cur["ids"] = sorted(set(cur["ids"]) | set(v["ids"]))
        cur["before"] = max(cur["before"], v["before"])
    return out


def write(root: str, tombs: Tombs) -> None:
    write_json(path(root), {str(s): v for s, v in tombs.items()})


def dead(tombs: Tombs, step: int, checkpoint_id: Any, created_unix: Any) -> bool:
    """Whether a copy of ``step`` (this commit, created then) was deleted for good."""
    t = tombs.get(step)
    if t is None:
        return False
    if checkpoint_id in t["ids"]:
        return True
    return isinstance(created_unix, (int, float)) and created_unix < t["before"]


def read_manifest(d: str) -> Manifest | None:
    """The manifest in directory ``d``, or None where it is missing or unreadable."""
    try:
        with open(os.path.join(d, MANIFEST_NAME), "rb") as f:
            return Manifest.from_bytes(f.read())
    except (OSError, ZerostallError):
        return None


def drop_dead(root: str, tombs: Tombs) -> list[tuple[str, int]]:
    """Remove the copies held under ``root/peers`` that ``tombs`` declares dead (start-up, before serving; CLI)."""
    area = os.path.join(root, "peers")
    gone = []
    for src, step, d in held_dirs(root):
        if step not in tombs:
            continue
        man = read_manifest(d)  # none readable: nothing to serve, nothing to keep
        if (man is None or dead(tombs, step, man.checkpoint_id, man.created_unix)) and drop_dir(d):
            gone.append((src, step))
    if gone:
        log.info("zerostall: removed copies of deleted steps %s from %s", gone, area)
    return gone


def delete_step(root: str, step: int, *, lock_timeout_s: float = 0.0) -> list[str]:
    """Delete ``step`` for good from ``root`` (takes the root's lock): its tombstone first, then
    the root's ``step-N`` and the copies of step N held here. Returns one line per thing removed."""
    tier = LocalTier(root, lock_timeout_s=lock_timeout_s)
    tier.own()
    try:
        ids = []
        if step in tier.listed_steps():
            with contextlib.suppress(ZerostallError):
                ids.append(tier.read_manifest(step).checkpoint_id)
        ids += [man.checkpoint_id for _, s, d in held_dirs(root) if s == step and (man := read_manifest(d))]
        tombs = merge(read(root), {step: {"ids": ids, "before": time.time()}})
        write(root, tombs)  # first: a crash from here on leaves the step deleted, never back
        done = []
        if step in tier.listed_steps():
            tier.delete(step)
            done.append(f"removed step {step} from {root}")
        done += [f"removed the copy of node {src}'s step {s} held in {root}"
                 for src, s in drop_dead(root, {step: tombs[step]})]
        return done
    finally:
        tier.release()
