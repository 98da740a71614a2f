"""The manifest: the JSON document that makes a directory a checkpoint.

It is written last, inside an envelope that carries the crc32c of the body::

    {"zerostall_manifest": "crc32c", "body_crc32c": "1a2b3c4d", "body": {...}}

``body`` holds ``format_version``, ``step``, ``world_size``, ``created_unix``,
``checkpoint_id``, ``alignment``, ``files`` (name, rank, host, file_bytes), ``tensors`` (key,
dtype, shape, file, offset, nbytes, crc32c) and ``tree`` (see :mod:`.tree`).
:meth:`Manifest.from_bytes` checks the envelope, the version and every field before anyone
reads a byte of a shard: paths cannot leave the checkpoint directory, offsets and sizes are
consistent, dtypes are known, shape products equal nbytes. No pickle, ever.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass, field
from typing import Any

import crc32c as _crc

from ..config import ALIGN_BYTES
from ..errors import CorruptCheckpoint
from .dtypes import dtype_from_name, itemsize
from .layout import HEADER_BYTES
from .tree import decode_tree, tree_tensor_indices

FORMAT_VERSION = 1
MANIFEST_NAME = "manifest.json"
MAX_MANIFEST_BYTES = 256 << 20
_FILE_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")
_MAX_DIM = (1 << 62)


@dataclass(frozen=True)
class TensorEntry:
    key: str
    dtype: str
    shape: tuple[int, ...]
    file: str
    offset: int
    nbytes: int
    crc32c: int

    def to_json(self) -> dict[str, Any]:
        return {"key": self.key, "dtype": self.dtype, "shape": list(self.shape), "file": self.file,
                "offset": self.offset, "nbytes": self.nbytes, "crc32c": self.crc32c}


@dataclass(frozen=True)
class FileEntry:
    name: str
    rank: int
    host: str
    file_bytes: int
    file_id: str = ""
    """The id in this shard's header (each rank draws its own); empty: the checkpoint's id."""

    def to_json(self) -> dict[str, Any]:
        out = {"name": self.name, "rank": self.rank, "host": self.host, "file_bytes": self.file_bytes}
        if self.file_id:
            out["file_id"] = self.file_id
        return out


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
        return sum(f.file_bytes for f in self.files)

    def body(self) -> dict[str, Any]:
        return {
            "format_version": self.format_version, "step": self.step, "world_size": self.world_size,
            "checkpoint_id": self.checkpoint_id, "created_unix": self.created_unix,
            "alignment": ALIGN_BYTES, "checksum": "crc32c",
            "files": [f.to_json() for f in self.files],
            "tensors": [t.to_json() for t in self.tensors],
            "tree": self.tree, "user_metadata": self.user_metadata,
            **({"rank_trees": list(self.rank_trees)} if self.rank_trees is not None else {}),
        }

    def to_bytes(self) -> bytes:
        body = _canonical(self.body())
        env = {"zerostall_manifest": "crc32c", "body_crc32c": f"{_crc.crc32c(body):08x}",
               "body": self.body()}
        return json.dumps(env, sort_keys=True, indent=1, allow_nan=False).encode() + b"\n"

    @classmethod
    def from_bytes(cls, raw: bytes, where: str = MANIFEST_NAME) -> "Manifest":
        """Parse and validate; raise :class:`CorruptCheckpoint` naming ``where`` on any defect."""

        def bad(msg: str) -> CorruptCheckpoint:
            return CorruptCheckpoint(f"{where}: {msg}", path=where)

        if len(raw) > MAX_MANIFEST_BYTES:
            raise bad(f"manifest is {len(raw)} bytes, over the {MAX_MANIFEST_BYTES} limit")
        try:
            env = json.loads(raw, parse_constant=_reject_constant)
        except (ValueError, RecursionError) as exc:
            raise bad(f"not valid JSON ({str(exc)[:120]})") from None
        if not isinstance(env, dict) or env.get("zerostall_manifest") != "crc32c":
            raise bad("not a zerostall manifest (missing or unknown 'zerostall_manifest' checksum)")
        body = env.get("body")
        if not isinstance(body, dict):
            raise bad("missing body")
        want = env.get("body_crc32c")
        got = f"{_crc.crc32c(_canonical(body)):08x}"
        if want != got:
            raise bad(f"manifest checksum mismatch (recorded {want!r}, computed {got!r})")
        version = body.get("format_version")
        if version != FORMAT_VERSION:
            raise bad(f"unknown format_version {version!r} (this zerostall reads {FORMAT_VERSION}; "
                      "upgrade zerostall to read newer checkpoints)")
        if body.get("checksum") != "crc32c":
            raise bad(f"unknown checksum {body.get('checksum')!r}")
        if body.get("alignment") != ALIGN_BYTES:
            raise bad(f"unsupported alignment {body.get('alignment')!r}")

        def integer(obj: dict[str, Any], k: str, lo: int = 0, hi: int = 1 << 62) -> int:
            v = obj.get(k)
            if not isinstance(v, int) or isinstance(v, bool) or not lo <= v <= hi:
                raise bad(f"field {k!r} = {v!r:.60} is not an integer in [{lo}, {hi}]")
            return v

        step = integer(body, "step")
        world = integer(body, "world_size", 1, 1 << 24)
        cid = body.get("checkpoint_id")
        created = body.get("created_unix")
        if not isinstance(cid, str) or not 0 < len(cid) <= 64:
            raise bad("bad checkpoint_id")
        if not isinstance(created, (int, float)) or isinstance(created, bool):
            raise bad("bad created_unix")
        files_raw, tensors_raw = body.get("files"), body.get("tensors")
        if not isinstance(files_raw, list) or not isinstance(tensors_raw, list):
            raise bad("'files' and 'tensors' must be lists")
        files: dict[str, FileEntry] = {}
        for f in files_raw:
            if not isinstance(f, dict):
                raise bad("file entry is not an object")
            name = f.get("name")
            if not isinstance(name, str) or not _FILE_RE.match(name) or name == MANIFEST_NAME:
                raise bad(f"file name {name!r:.80} is not a plain file name inside the checkpoint")
            if name in files:
                raise bad(f"file {name!r} listed twice")
            fb = integer(f, "file_bytes")
            if fb % ALIGN_BYTES or fb < HEADER_BYTES:
                raise bad(f"file {name!r}: file_bytes {fb} is not a multiple of {ALIGN_BYTES} >= header")
            host, fid = f.get("host"), f.get("file_id", "")
            if not isinstance(fid, str) or len(fid) > 64:
                raise bad(f"file {name!r}: bad file_id")
            files[name] = FileEntry(name, integer(f, "rank", 0, world - 1),
                                    host if isinstance(host, str) else "", fb, fid)
        tensors: list[TensorEntry] = []
        for t in tensors_raw:
            if not isinstance(t, dict):
                raise bad("tensor entry is not an object")
            key = t.get("key")
            if not isinstance(key, str):
                raise bad("tensor entry without a key")
            dt = t.get("dtype")
            dtype = dtype_from_name(dt, where=f"{where}: tensor {key!r}")
            shape = t.get("shape")
            if not isinstance(shape, list) or len(shape) > 64 or not all(
                    isinstance(d, int) and not isinstance(d, bool) and 0 <= d < _MAX_DIM for d in shape):
                raise bad(f"tensor {key!r}: bad shape {shape!r:.80}")
            nbytes = integer(t, "nbytes")
            if math.prod(shape) * itemsize(dtype) != nbytes:
                raise bad(f"tensor {key!r}: shape {shape} x {dt} is not {nbytes} bytes")
            fname = t.get("file")
            if fname not in files:
                raise bad(f"tensor {key!r}: file {fname!r:.80} is not listed in 'files'")
            off = integer(t, "offset")
            if off % ALIGN_BYTES or off < HEADER_BYTES or off + nbytes > files[fname].file_bytes:
                raise bad(f"tensor {key!r}: offset {off} + {nbytes} bytes lies outside "
                          f"{fname!r} ({files[fname].file_bytes} bytes) or is unaligned")
            tensors.append(TensorEntry(key, dt, tuple(shape), fname, off, nbytes,
                                       integer(t, "crc32c", 0, 0xFFFFFFFF)))
        rank_trees = body.get("rank_trees")
        if rank_trees is not None and (not isinstance(rank_trees, list) or len(rank_trees) != world):
            raise bad("'rank_trees' must list one tree per rank")
        for tree in [body.get("tree")] + (rank_trees or []):
            for idx, _ in tree_tensor_indices(tree):
                if not isinstance(idx, int) or isinstance(idx, bool) or not 0 <= idx < len(tensors):
                    raise bad(f"state tree refers to tensor {idx!r:.40}, which is not in 'tensors'")
        for tree in [body.get("tree")] + (rank_trees or []):
            decode_tree(tree, [None] * len(tensors), where=where,  # structure only: unknown tags fail here
                        build_objects=False)
        meta = body.get("user_metadata", {})
        return cls(step=step, world_size=world, checkpoint_id=cid, created_unix=float(created),
                   files=tuple(files.values()), tensors=tuple(tensors), tree=body.get("tree"),
                   user_metadata=meta if isinstance(meta, dict) else {}, format_version=version,
                   rank_trees=tuple(rank_trees) if rank_trees is not None else None)


def _canonical(body: Any) -> bytes:
    return json.dumps(body, sort_keys=True, separators=(",", ":"), allow_nan=False).encode()


def _reject_constant(name: str) -> Any:
    raise ValueError(f"non-standard JSON constant {name}")
