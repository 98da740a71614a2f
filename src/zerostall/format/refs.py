"""References: manifest entries whose bytes live in an earlier step's shard (incremental saves).

A manifest may list, besides its own ``files``, the shard files of earlier steps it borrows
bytes from::

    "ref_files": [{"step": 40, "name": "rank-00000.shard", "rank": 0,
                   "file_bytes": 1073745920, "file_id": "9f0c..."}]

A reference always names the step that *wrote* the bytes, so reading one never follows a
chain. Retention keeps every step a kept step references (:func:`closure`). Pure functions.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any, Callable, Iterable

from .validate import MAX_DIM, bad, file_fields


@dataclass(frozen=True)
class RefFile:
    """A shard file of an earlier step that this manifest borrows tensors from."""

    step: int
    name: str
    rank: int
    file_bytes: int
    file_id: str

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


def parse_ref_files(raw: Any, step: int, where: str) -> dict[tuple[int, str], RefFile]:
    """Validate a manifest body's ``ref_files``; keyed by (step, name)."""
    if not isinstance(raw, list) or not raw:
        raise bad(where, "a manifest with references requires a non-empty 'ref_files' list "
                         "(one without omits it)")
    out: dict[tuple[int, str], RefFile] = {}
    for r in raw:
        s = r.get("step") if isinstance(r, dict) else None  # not an object: file_fields says so
        if isinstance(r, dict) and (type(s) is not int or s < 0):
            raise bad(where, f"ref_files: field 'step' = {s!r:.60} is not a non-negative integer")
        # every step's shards share their names: the step is part of what an error names
        name, rank, fb, fid, _ = file_fields(r, where, f"ref_files: step {s}: " if s is not None else "ref_files: ",
                                             MAX_DIM)
        if s >= step:
            raise bad(where, f"ref_files: step {s} is not earlier than this step ({step})")
        if not fid:
            raise bad(where, f"ref_files: step-{s}/{name}: bad file_id")
        if (s, name) in out:
            raise bad(where, f"ref_files: step-{s}/{name} listed twice")
        out[(s, name)] = RefFile(s, name, rank, fb, fid)
    return out


def referenced_steps(manifest: Any) -> set[int]:
    """Steps whose files ``manifest`` borrows from."""
    return {r.step for r in getattr(manifest, "ref_files", ())}


def closure(kept: Iterable[int], refs_of: Callable[[int], set[int]]) -> set[int]:
    """``kept`` plus every step they reference, transitively. ``refs_of(step)`` reads that
    step's manifest (an unreadable one references nothing: it cannot be loaded)."""
    out: set[int] = set()
    todo = list(kept)
    while todo:
        s = todo.pop()
        if s in out:
            continue
        out.add(s)
        todo.extend(refs_of(s) - out)
    return out
