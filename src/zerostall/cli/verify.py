"""``zerostall verify``: read and check every byte of a checkpoint, on any tier; on a node-local
copy of the root, the shards that copy holds. Called by :mod:`.cli` on the main thread."""

from __future__ import annotations

import argparse
import sys
from typing import Any

from . import dcp as cli_dcp
from .._term import safe
from .._util import human_bytes as _human
from .commands import _engine, _tier, say as _say, verdict
from ..errors import CheckpointNotFound, CorruptCheckpoint
from ..store.tier import is_url
from ..restore import verify_step, verify_tier_step
from ..restore.pipeline import verify_consistent
from ..distributed.node import node_id


def cmd_verify(a: argparse.Namespace) -> int:
    if not is_url(a.path) and cli_dcp.is_dcp_dir(a.path):  # a DCP checkpoint directory
        return cli_dcp.cmd_verify(a)
    tier = _tier(a.path)
    steps = [a.step] if a.step is not None else tier.listed_steps()
    rows: list[dict[str, Any]] = []  # --json: one per step, printed at the end
    if not steps:  # an existing, empty root: nothing failed (a missing one raised RootNotFound)
        print("[]" if a.json else f"no checkpoints in {safe(tier.url)}")
        return 0
    remote = is_url(a.path)
    engine = None if remote else _engine(a.engine, tier.root)
    try:
        for s in steps:
            away: list[Any] = []
            try:  # a step replaced under us is read again, one deleted meanwhile is skipped (as load does)
                m = verify_consistent(tier, s, lambda s=s: verify_tier_step(tier, s) if remote
                                      else verify_step(tier, s, engine, only=lambda man: _this_copy(
                                          tier, man, a.node, a.all_files, away)))
                if m is None and a.step is not None:  # asked for by number: not there is a failure
                    raise CheckpointNotFound(f"no committed step {s} in {tier.url}")
                if m is None:
                    rows.append({"step": s, "state": "deleted"})
                    _say(a, f"step {s}: deleted while verifying it (retention?); skipped")
                    continue
                ref_steps = sorted({r.step for r in m.ref_files})
                rows.append({"step": s, "state": "ok", "tensors": len(m.tensors), "bytes_owned": m.total_bytes,
                             "bytes_referenced": m.referenced_bytes, "references_steps": ref_steps,
                             "ranks_elsewhere": [f.rank for f in away],
                             "hosts_elsewhere": sorted({f.host for f in away})})
                refs = (f" + {_human(m.referenced_bytes)} referenced in step(s) "
                        f"{', '.join(str(x) for x in ref_steps)}" if m.ref_files else "")
                _say(a, f"step {s}: OK ({len(m.tensors)} tensors, {_human(m.total_bytes)} owned{refs} verified)")
                if away:
                    _say(a, f"  ranks {', '.join(str(f.rank) for f in away)} are in other nodes' copies "
                            f"({safe(', '.join(sorted({f.host for f in away})))}), not in this one: verify them "
                            "there (or pass --all-files to require every shard here)")
            except (CorruptCheckpoint, CheckpointNotFound) as exc:
                rows.append({"step": s, "state": "failed", "error": str(exc)})
                print(f"step {s}: FAILED: {safe(exc)}", file=sys.stderr)
    finally:
        if engine is not None:
            engine.close()
    return verdict(a, rows)


def _this_copy(tier: Any, man: Any, node: str | None, all_files: bool, away: list[Any]) -> set[str] | None:
    """The shard files a node-local copy of the root should hold; None: all (``--all-files``, a
    shared root). A shard is another copy's (not checked, listed in ``away``) only when it was
    written on a node none of this copy's files come from and that is not this node (``--node``,
    default ``ZEROSTALL_NODE`` or the host name); any other missing shard fails as missing."""
    away.clear()
    if all_files:
        return None
    here = [fe for fe in man.files if tier.stat(f"step-{man.step}/{fe.name}") is not None]
    if not here:  # nothing of this step in this root: fail as missing
        return None
    hosts = {fe.host for fe in here} | {node or node_id()}
    away.extend(fe for fe in man.files if fe.host not in hosts)
    return {fe.name for fe in man.files if fe.host in hosts} if away else None
