"""``peers/.status.json`` in a node's root: which nodes held each step's files when its
replication finished, and whether the step was protected -- for ``zerostall ls``/``doctor``.
Written atomically by the node leader's watcher thread; a hint, never trusted by a restore.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import socket
import stat
import threading
import uuid
from typing import Any

from .._util import human_bytes
from ..errors import ZerostallError
from ..format.validate import read_small
from ..store.atomic import fsync_dir, write_file_durable
from .wire import NODE_RE, recv_msg

NAME = ".status.json"
_STEP_RE = re.compile(r"^step-(\d{1,19})$")
_mu = threading.Lock()


def path(root: str) -> str:
    return os.path.join(root, "peers", NAME)


def read_json(p: str) -> Any:
    """The JSON in ``p`` (this file, :mod:`.tombstones`'), or None: missing, over 4 MiB, unreadable."""
    try:
        return json.loads(read_small(p, 1 << 22))
    except (OSError, ValueError, ZerostallError):
        return None


def write_json(p: str, doc: Any) -> None:
    """``doc`` into ``p`` atomically and durably (a crash's ``*.tmp``: :meth:`.store.PeerStore.clean`)."""
    os.makedirs(os.path.dirname(p), exist_ok=True)
    tmp = f"{p}.{uuid.uuid4().hex[:8]}.tmp"
    write_file_durable(tmp, json.dumps(doc, sort_keys=True).encode())
    os.rename(tmp, p)
    fsync_dir(os.path.dirname(p))


def read(root: str) -> dict[str, Any]:
    """``{"node": name, "steps": {step: {"protected": bool, "holders": {node: [...]}}}}`` or {}."""
    doc = read_json(path(root))
    return doc if isinstance(doc, dict) and isinstance(doc.get("steps"), dict) else {}


def record(root: str, me: str, step: int, protected: bool, holders: dict[str, list[str]], keep: list[int],
           endpoints: dict[str, str] | None = None, usage: dict[str, dict[str, Any]] | None = None,
           coded: dict[str, Any] | None = None) -> None:
    """Add ``step``'s outcome; forget steps not in ``keep``. ``usage``: every node's
    :meth:`.store.PeerStore.usage`; ``coded``: ``{"code": [k, m], "fragments": {node: {holder: index}}}``."""
    with _mu:
        doc = read(root)
        steps = {k: v for k, v in doc.get("steps", {}).items() if int(k) in keep}
        steps[str(step)] = {"protected": protected, "holders": holders, **(coded or {})}
        write_json(path(root), {"node": me, "steps": steps, "endpoints": endpoints or doc.get("endpoints", {}),
                                "usage": usage if usage is not None else doc.get("usage", {}),
                                "usage_step": step if usage is not None else doc.get("usage_step")})


def peer_rows(root: str, rows: list[dict[str, Any]]) -> None:
    """``zerostall ls``: this node's committed steps' holders and protection; a row per copy held here."""
    doc = read(root)
    me, steps = doc.get("node"), doc.get("steps", {})
    for r in rows:
        st = steps.get(str(r["step"]))
        if st is not None and r["state"] == "committed":
            mine = st.get("holders", {}).get(me, [])
            r["holders"], r["protected"] = [me, *mine], bool(st.get("protected"))
            usage = _usage(doc)
            r["holder_usage"] = {h: usage[h] for h in mine if h in usage}
            r["tier"] = f"local+peers({','.join(mine)})" + (" protected" if r["protected"] else " NOT protected")
            if (code := _code(st, me)) is not None:
                k, m, frags = code
                r["fragments"], r["rebuildable"] = frags, len(frags) >= k
                r["tier"] = (f"local+RS({k},{m}) fragments {len(frags)}/{k + m} on {','.join(sorted(frags))}"
                             + (" protected" if r["protected"] else
                                " NOT protected" + ("" if r["rebuildable"] else ", NOT rebuildable")))
    for src, step, d in held_dirs(root):
        files = sorted(f for f in os.listdir(d) if f.endswith(".shard") or f.startswith("fragment-"))
        if files:  # none: a copy cut before any file arrived (its manifest only)
            rows.append({"step": step, "bytes": sum(os.path.getsize(os.path.join(d, f)) for f in files),
                         "tensors": 0, "created_unix": 0, "state": f"held for node {src}: {', '.join(files)}",
                         "tier": f"peer copy of {src}"})


def _code(st: dict[str, Any], me: Any) -> tuple[int, int, dict[str, Any]] | None:
    """``(k, m, {holder: fragment index} of node me)`` of a coded step's record, else None."""
    code = st.get("code")
    if isinstance(code, list) and len(code) == 2 and all(type(v) is int and v > 0 for v in code) \
            and isinstance(st.get("fragments", {}), dict):
        return code[0], code[1], st.get("fragments", {}).get(me, {})
    return None


def _usage(doc: dict[str, Any]) -> dict[str, dict[str, Any]]:
    usage = doc.get("usage")
    return {str(n): u for n, u in usage.items() if isinstance(u, dict)} if isinstance(usage, dict) else {}


def quota_state(u: dict[str, Any]) -> tuple[str, str]:
    """``(text, verdict)`` for one node's usage: ``ok``, ``near`` (``next_bytes`` more would not
    fit), ``over`` (beyond the quota, or copies refused), ``none`` (no quota) or ``bad``."""
    nums = [u.get(k) for k in ("used_bytes", "quota_bytes", "next_bytes", "refused")]
    if not all(v is None or (type(v) is int and v >= 0) for v in nums):  # a damaged hint: say so, go on
        return "usage unreadable", "bad"
    used, quota, nxt, refused = nums[0] or 0, nums[1], nums[2] or 0, nums[3] or 0
    if quota is None:
        return f"{human_bytes(used)} of peers' copies (no quota)", "none"
    text = f"{human_bytes(used)} of {human_bytes(quota)} quota ({100 * used / max(quota, 1):.0f}%)"
    if refused:
        text += f", {refused} copies refused"
    if used > quota or refused:
        return text, "over"
    if used + nxt > quota:
        return text + f"; the next copies need {human_bytes(nxt)} more", "near"
    return text, "ok"


def quota_lines(root: str) -> list[str]:
    """``zerostall ls``: each node's peer area against its quota (this node's own read from disk now)."""
    doc = read(root)
    usage = _usage(doc)
    me = doc.get("node")
    if me in usage:
        usage[me] = {**usage[me], "used_bytes": area_bytes(root)}
    lines = []
    for node, u in sorted(usage.items()):
        text, verdict = quota_state(u)
        lines.append(f"  {node}: {text}" + ({"near": "  NEAR QUOTA", "over": "  OVER QUOTA"}.get(verdict, "")))
    if lines:
        lines.insert(0, f"peers' copies held by each node (as of step {doc.get('usage_step')}):")
    return lines


def held_dirs(root: str) -> list[tuple[str, int, str]]:
    """``(src node, step, directory)`` of every ``peers/<src>/step-<N>`` under ``root``, sorted."""
    area = os.path.join(root, "peers")
    out = []
    for src in sorted(os.listdir(area)) if os.path.isdir(area) else []:
        d = os.path.join(area, src)
        if not NODE_RE.match(src) or os.path.islink(d) or not os.path.isdir(d):
            continue
        out.extend((src, int(m.group(1)), os.path.join(d, n)) for n in sorted(os.listdir(d))
                   if (m := _STEP_RE.match(n)))
    return out


def drop_dir(d: str) -> bool:
    """Remove the held step directory ``d`` (``peers/<src>/step-<N>``): renamed to
    ``peers/.deleting-*`` (durably: never half there) and deleted; False when it was gone."""
    area = os.path.dirname(os.path.dirname(d))
    gone = os.path.join(area, f".deleting-{uuid.uuid4().hex[:8]}")
    try:
        os.rename(d, gone)
    except FileNotFoundError:
        return False
    fsync_dir(area)
    shutil.rmtree(gone, ignore_errors=True)  # what is left: removed at start-up (PeerStore.clean)
    return True


def area_bytes(root: str) -> int:
    """Bytes of the files held under ``root/peers`` (not dot-names: transfers, deletions)."""
    total = 0
    for d, dirs, files in os.walk(os.path.join(root, "peers")):
        dirs[:] = [x for x in dirs if not x.startswith(".")]
        total += sum(max(file_size(os.path.join(d, f)), 0) for f in files if not f.startswith("."))
    return total


def file_size(path: str) -> int:
    """The size of regular file ``path`` (not following a link), -1 for anything else."""
    try:
        st = os.stat(path, follow_symlinks=False)
    except OSError:
        return -1
    return st.st_size if stat.S_ISREG(st.st_mode) else -1


def doctor_checks(root: str, timeout_s: float = 1.0) -> list[tuple[str, Any, str, str]]:
    """``zerostall doctor ROOT``: ``(name, value, status, advice)`` rows of the newest step's
    protection, each node's quota, and whether each peer's server answers (without the secret:
    the peers log the connection as refused)."""
    doc = read(root)
    if not doc:
        return []
    out: list[tuple[str, Any, str, str]] = []
    steps, me = doc.get("steps", {}), doc.get("node")
    if steps:
        s = max(steps, key=int)
        ok = bool(steps[s].get("protected"))
        if (code := _code(steps[s], me)) is not None:
            k, m, frags = code
            text = f"step {s}: RS({k},{m}), {len(frags)} of {k + m} fragments held ({', '.join(sorted(frags))})"
            out.append(("peer_fragments", text, "ok" if ok else "warn", "" if ok else
                        "the newest step is not protected: " + (
                            f"it survives the loss of this node and {len(frags) - k} of its holders"
                            if len(frags) >= k else "it cannot be rebuilt if this node is lost")))
        else:
            nodes = [me or "?", *steps[s].get("holders", {}).get(me, [])]
            out.append(("peer_replicas", f"step {s}: held by {', '.join(nodes)}", "ok" if ok else "warn",
                        "" if ok else "the newest step is not protected: a lost node loses it"))
    raise_it = "raise peers.quota_bytes / peers.quota_fraction on that node or lower keep_last"
    for node, u in sorted(_usage(doc).items()):
        text, verdict = quota_state(u)
        advice = {"near": f"near its quota: the next copies may be refused and steps left unprotected; {raise_it}",
                  "over": f"over its quota: copies are refused and steps left unprotected; {raise_it}",
                  "bad": f"the usage hint in {path(root)} is damaged; the next step's copies record it again",
                  }.get(verdict, "")
        out.append((f"peer_quota {node}", text, "warn" if advice else "ok", advice))
    for node, ep in sorted(doc.get("endpoints", {}).items()):
        host, _, port = ep.rpartition(":")
        try:
            with socket.create_connection((host, int(port)), timeout=timeout_s) as c:
                c.settimeout(timeout_s)
                hello = recv_msg(c)
            ok = hello.get("node") == node
            out.append((f"peer {node}", ep, "ok" if ok else "warn", "" if ok else f"answered as {hello.get('node')!r}"))
        except (OSError, ValueError, ZerostallError) as exc:
            out.append((f"peer {node}", ep, "warn", f"not reachable ({exc}); fine when the job is not running"))
    return out
