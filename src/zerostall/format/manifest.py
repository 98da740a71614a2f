"""The manifest: the JSON document that makes a directory a checkpoint.

It is written last, inside an envelope that carries the crc32c of the body's bytes as written::

    {"zerostall_manifest": "crc32c", "body_crc32c": "1a2b3c4d", "body": {...}}

``body`` holds ``format_version``, ``step``, ``world_size``, ``created_unix``,
``checkpoint_id``, ``alignment`` (the shard layout), ``files``, ``tensors`` (:mod:`.table`),
``tree`` (:mod:`.tree`) and, for references, ``ref_files`` (:mod:`.refs`). Another version or
layout, or a re-encoded body, is refused naming the file and what to do;
:meth:`Manifest.from_bytes` checks everything (:mod:`.validate`) before a shard byte is read.
"""

from __future__ import annotations

import functools
import json
from dataclasses import asdict, dataclass, field
from typing import Any

import crc32c as _crc

from .._fast import Splice
from .._util import no_gc
from ..config import ALIGN_BYTES
from ..errors import CorruptCheckpoint
from . import validate as V
from .layout import LAYOUT_VERSION, MANIFEST_ALIGNMENT, version_advice
from .refs import RefFile, parse_ref_files
from .table import FORMAT_VERSION_TABLE, Entries, TensorEntry, encode_columns, file_slots, parse_columns, tensors_json
from .decode import decode_tree

__all__ = ["FORMAT_VERSION", "MANIFEST_NAME", "Entries", "FileEntry", "Manifest", "TensorEntry", "tensors_json"]

FORMAT_VERSION = FORMAT_VERSION_TABLE
MANIFEST_NAME = "manifest.json"
MAX_MANIFEST_BYTES = 512 << 20
"""Readers refuse larger manifests (a hostile one cannot make them parse gigabytes)."""
_SPLICE = Splice("manifest")
_PREFIX = b'{"zerostall_manifest":"crc32c","body_crc32c":"'
_MID = b'","body":'


@dataclass(frozen=True)
class FileEntry:
    name: str
    rank: int
    host: str
    file_bytes: int
    file_id: str = ""
    """The id in this shard's header (each rank draws its own); empty: the checkpoint's id."""

    def to_json(self) -> dict[str, Any]:
        return {k: v for k, v in asdict(self).items() if v or k != "file_id"}


@dataclass(frozen=True)
class Manifest:
    step: int
    world_size: int
    checkpoint_id: str
    created_unix: float
    files: tuple[FileEntry, ...]
    tensors: tuple[TensorEntry, ...]
    tree: Any
    user_metadata: dict[str, Any] = field(default_factory=dict)
    format_version: int = FORMAT_VERSION
    rank_trees: tuple[Any, ...] | None = None
    """Per-rank state trees (``dist_mode="per_rank"``, world size > 1); else ``tree`` is the state."""
    ref_files: tuple[RefFile, ...] = ()
    """Earlier steps' shards that entries with ``step`` set live in (incremental saves)."""
    tree_json: str = field(default="", compare=False, repr=False)
    """``tree`` already encoded as compact JSON (the save plan's), spliced in by :meth:`to_bytes`."""
    tensors_json: str = field(default="", compare=False, repr=False)
    """``tensors`` already encoded (:func:`~.table.tensors_json`), spliced in by :meth:`to_bytes`."""
    alias_of: dict[int, int] = field(default_factory=dict, compare=False, repr=False)
    """Entries that duplicate an earlier one exactly (index -> first index): read and allocated once."""

    def tree_for(self, rank: int, world_size: int) -> Any:
        if self.rank_trees is None:
            return self.tree
        if world_size != self.world_size:
            raise CorruptCheckpoint(
                f"step {self.step} was saved per rank at world size {self.world_size}; load it at that world "
                f"size (this is {world_size}), or save with zerostall.dcp for resharding")
        return self.rank_trees[rank]

    @property
    def total_bytes(self) -> int:
        """Bytes this step owns (its own shard files)."""
        return sum(f.file_bytes for f in self.files)

    @property
    def referenced_bytes(self) -> int:
        """Payload bytes this step borrows from earlier steps' files."""
        return sum(t.nbytes for t in self.tensors if t.step is not None)

    def body(self, encode_tensors: bool = True, objects: bool = False) -> dict[str, Any]:
        """The body as written; ``objects``: one object per tensor (``inspect --json``, for people)."""
        if objects:
            return {**self.body(False), "format_version": self.format_version,
                    "tensors": [t.to_json() for t in self.tensors]}
        return {
            "format_version": FORMAT_VERSION_TABLE, "step": self.step, "world_size": self.world_size,
            "checkpoint_id": self.checkpoint_id, "created_unix": self.created_unix,
            "alignment": MANIFEST_ALIGNMENT, "checksum": "crc32c",
            "files": [f.to_json() for f in self.files],
            "tensors": encode_columns(self.tensors, [f.name for f in self.files], self.ref_files)
            if encode_tensors else None,
            "tree": self.tree, "user_metadata": self.user_metadata,
            **({"rank_trees": list(self.rank_trees)} if self.rank_trees is not None else {}),
            **({"ref_files": [r.to_json() for r in self.ref_files]} if self.ref_files else {}),
        }

    def to_bytes(self) -> bytes:
        """The envelope; the crc32c covers the exact bytes of ``body`` as written."""
        d = self.body(encode_tensors=not self.tensors_json)
        pieces: list[str] = []  # encoded before: spliced in
        for k, v in (("tree", self.tree_json), ("tensors", self.tensors_json)):
            if v:
                d[k] = _SPLICE.mark(len(pieces))
                pieces.append(v)
        return envelope(_SPLICE.splice(json.dumps(d, separators=(",", ":"), allow_nan=False), pieces).encode())

    @classmethod
    @no_gc()
    def from_bytes(cls, raw: bytes, where: str = MANIFEST_NAME) -> "Manifest":
        """Parse and validate; raise :class:`CorruptCheckpoint` naming ``where`` on any defect."""

        bad = functools.partial(V.bad, where)
        raw = bytes(raw)  # a bytearray or memoryview too
        if len(raw) > MAX_MANIFEST_BYTES:
            raise bad(f"manifest is {len(raw)} bytes, over the {MAX_MANIFEST_BYTES} limit")
        env = V.loads(raw, where)
        if not isinstance(env, dict) or env.get("zerostall_manifest") != "crc32c":
            raise bad("not a zerostall manifest (missing or unknown 'zerostall_manifest' checksum)")
        body = env.get("body")
        if not isinstance(body, dict):
            raise bad("missing body")
        version = body.get("format_version")
        advice = (version_advice("format_version", version, FORMAT_VERSION)
                  if type(version) is int and version != FORMAT_VERSION else None)
        n = len(_PREFIX) + 8 + len(_MID)
        if not raw.startswith(_PREFIX) or raw[len(_PREFIX) + 8:n] != _MID:
            raise bad(advice or "the envelope is not the one this zerostall writes (its crc32c does not cover the "
                      "body's bytes as written: an earlier zerostall's form, or a tool re-encoded the file); load "
                      "the checkpoint with the zerostall that wrote it and save it again")
        want = env.get("body_crc32c")
        tail = 2 if raw.endswith(b"}\n") else 1
        got = f"{_crc.crc32c(raw[n:len(raw) - tail]):08x}"
        if want != got:
            raise bad(f"manifest checksum mismatch (recorded {want!r:.20}, computed {got!r})")
        if type(version) is not int or advice:
            raise bad(advice or f"unknown format_version {version!r:.40} (this zerostall reads only {FORMAT_VERSION})")
        if body.get("checksum") != "crc32c":
            raise bad(f"unknown checksum {body.get('checksum')!r:.40}")
        alignment = body.get("alignment")
        if type(alignment) is int and alignment == ALIGN_BYTES:  # every tensor on its own page
            raise bad(f"alignment {ALIGN_BYTES}: {version_advice('shard layout version', 1, LAYOUT_VERSION)}")
        if type(alignment) is not int or alignment != MANIFEST_ALIGNMENT:
            raise bad(f"unsupported alignment {alignment!r:.40} (this zerostall reads only {MANIFEST_ALIGNMENT}, "
                      f"shard layout {LAYOUT_VERSION}; upgrade zerostall to read newer checkpoints)")

        step = V.integer(body, "step", where, 0, V.MAX_STEP)
        world = V.integer(body, "world_size", where, 1, 1 << 24)
        cid = body.get("checkpoint_id")
        created = body.get("created_unix")
        if not isinstance(cid, str) or not 0 < len(cid) <= 64:
            raise bad("bad checkpoint_id")
        if type(created) not in (int, float) or not -1e12 < created < 1e12:
            raise bad(f"bad created_unix {created!r:.40}")
        files_raw, tensors_raw = body.get("files"), body.get("tensors")
        if not isinstance(files_raw, list):
            raise bad("'files' must be a list")
        files: dict[str, FileEntry] = {}
        for f in files_raw:
            name, rank, fb, fid, host = V.file_fields(f, where, "", world - 1)
            if name in files:
                raise bad(f"file {name!r} listed twice")
            files[name] = FileEntry(name, rank, host, fb, fid)
        refs = parse_ref_files(body["ref_files"], step, where) if "ref_files" in body else {}
        tensors, spans = parse_columns(tensors_raw, file_slots(list(files), list(refs.values())), where, bad)
        alias = V.check_spans(spans, {**{f.name: f.file_bytes for f in files.values()},
                                      **{f"step-{r.step}/{r.name}": r.file_bytes for r in refs.values()}}, where)
        rank_trees = body.get("rank_trees")
        if rank_trees is not None and (not isinstance(rank_trees, list) or len(rank_trees) != world):
            raise bad("'rank_trees' must list one tree per rank")
        dtypes = [t.dtype for t in tensors]
        for tree in [body.get("tree")] + (rank_trees or []):
            decode_tree(tree, dtypes, where=where, build_objects=False)
        meta = body.get("user_metadata", {})
        if not isinstance(meta, dict):
            raise bad("'user_metadata' is not an object")
        return cls(step=step, world_size=world, checkpoint_id=cid, created_unix=float(created),
                   files=tuple(files.values()), tensors=tuple(tensors), tree=body.get("tree"),
                   user_metadata=meta, format_version=version,
                   rank_trees=tuple(rank_trees) if rank_trees is not None else None, alias_of=alias,
                   ref_files=tuple(refs.values()))


def envelope(body: bytes) -> bytes:
    """The manifest file around ``body`` (compact JSON), its crc32c over ``body``'s bytes."""
    return b"".join((_PREFIX, f"{_crc.crc32c(body):08x}".encode(), _MID, body, b"}\n"))
