"""``peers/.status.json`` in a node's root: which nodes held each step's files when its
replication finished, and whether the step was protected -- for ``zerostall ls``, which runs
outside the job and cannot ask the peers.

Written by the node leader's watcher thread (atomically: a temporary file, fdatasync,
rename); read by the CLI from any process. A hint for humans and tools, like ``latest``:
restore never trusts it (it asks the live peers).
"""

from __future__ import annotations

import json
import os
import threading
from typing import Any

from ..errors import ZerostallError
from ..store.atomic import write_file_durable

NAME = ".status.json"
_mu = threading.Lock()


def path(root: str) -> str:
    return os.path.join(root, "peers", NAME)


def read(root: str) -> dict[str, Any]:
    """``{"node": name, "steps": {step: {"protected": bool, "holders": {node: [...]}}}}`` or {}."""
    try:
        with open(path(root), "rb") as f:
            doc = json.loads(f.read(1 << 20))
        return doc if isinstance(doc, dict) and isinstance(doc.get("steps"), dict) else {}
    except (OSError, ValueError):
        return {}


def record(root: str, me: str, step: int, protected: bool, holders: dict[str, list[str]], keep: list[int],
           endpoints: dict[str, str] | None = None) -> None:
    """Add ``step``'s outcome; forget steps not in ``keep`` (the root's committed steps)."""
    with _mu:
        doc = read(root)
        steps = {k: v for k, v in doc.get("steps", {}).items() if int(k) in keep}
        steps[str(step)] = {"protected": protected, "holders": holders}
        os.makedirs(os.path.dirname(path(root)), exist_ok=True)
        tmp = path(root) + ".tmp"
        body = {"node": me, "steps": steps, "endpoints": endpoints or doc.get("endpoints", {})}
        write_file_durable(tmp, json.dumps(body, sort_keys=True).encode())
        os.rename(tmp, path(root))


def peer_rows(root: str, rows: list[dict[str, Any]]) -> None:
    """``zerostall ls``: mark this node's committed steps with their peer holders and whether
    they were protected; add a row per step held here for another node."""
    doc = read(root)
    me, steps = doc.get("node"), doc.get("steps", {})
    for r in rows:
        st = steps.get(str(r["step"]))
        if st is not None and r["state"] == "committed":
            mine = st.get("holders", {}).get(me, [])
            r["holders"], r["protected"] = [me, *mine], bool(st.get("protected"))
            r["tier"] = f"local+peers({','.join(mine)})" + (" protected" if r["protected"] else " NOT protected")
    area = os.path.join(root, "peers")
    for src in sorted(os.listdir(area)) if os.path.isdir(area) else []:
        d = os.path.join(area, src)
        if src.startswith(".") or not os.path.isdir(d):
            continue
        for name in sorted(os.listdir(d)):
            if name.startswith("step-") and name[5:].isdigit():
                files = sorted(f for f in os.listdir(os.path.join(d, name)) if f.endswith(".shard"))
                rows.append({"step": int(name[5:]), "bytes": sum(os.path.getsize(os.path.join(d, name, f))
                                                                 for f in files),
                             "tensors": 0, "created_unix": 0, "state": f"held for node {src}: {', '.join(files)}",
                             "tier": f"peer copy of {src}"})


def doctor_checks(root: str, timeout_s: float = 1.0) -> list[tuple[str, Any, str, str]]:
    """``zerostall doctor ROOT``: the newest step's protection, and whether each peer's server
    (as last recorded) answers with its node name -- ``(name, value, status, advice)`` rows.
    Connects without the job's secret: the peers log the connection as refused."""
    import socket

    from .wire import recv_msg
    doc = read(root)
    if not doc:
        return []
    out: list[tuple[str, Any, str, str]] = []
    steps = doc.get("steps", {})
    if steps:
        s = max(steps, key=int)
        ok = bool(steps[s].get("protected"))
        nodes = [doc.get("node", "?"), *steps[s].get("holders", {}).get(doc.get("node"), [])]
        out.append(("peer_replicas", f"step {s}: held by {', '.join(nodes)}", "ok" if ok else "warn",
                    "" if ok else "the newest step is not protected: a lost node loses it"))
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
