"""The manifest: the JSON document that makes a directory a checkpoint.

It is written last, inside an envelope that carries the crc32c of the body::

    {"zerostall_manifest": "crc32c", "body_crc32c": "1a2b3c4d", "body": {...}}

``body`` holds ``format_version``, ``step``, ``world_size``, ``created_unix``,
``checkpoint_id``, ``alignment`` (the shard layout: ``4096`` every tensor on its own page,
layout 1, written before 0.5; ``64`` small tensors packed, layout 2: see :mod:`.layout`), ``files`` (name, rank, host, file_bytes), ``tensors`` (key,
dtype, shape, file, offset, nbytes, crc32c) and ``tree`` (see :mod:`.tree`). Version 2 adds
references to earlier steps' bytes (``ref_files``, a tensor's ``step``; see :mod:`.refs`);
a save without references still writes version 1.
:meth:`Manifest.from_bytes` checks the envelope, the version and every field before anyone
reads a byte of a shard: paths cannot leave the checkpoint directory, offsets and sizes are
consistent, dtypes are known, shape products equal nbytes. No pickle, ever.
"""

from __future__ import annotations

import json
import operator
import re
import uuid
from dataclasses import dataclass, field
from collections.abc import Sequence
from typing import Any, Iterator

import crc32c as _crc

from ..config import ALIGN_BYTES
from ..errors import CorruptCheckpoint
from .dtypes import DTYPE_NAMES, dtype_from_name, itemsize
from . import validate as V
from . import layout as _layout
from .layout import HEADER_BYTES, MANIFEST_ALIGNMENT
from .refs import FORMAT_VERSION_REFS, RefFile, parse_ref_files
from .tree import decode_tree, tree_tensor_indices

FORMAT_VERSION = 1
MANIFEST_NAME = "manifest.json"
MAX_MANIFEST_BYTES = 512 << 20
"""Readers refuse larger manifests (a hostile one cannot make them parse gigabytes). A state
of 1M tensors needs ~230 MB (entries ~169 B each with their key, plus the tree)."""
_ITEMSIZE_BY_NAME = {name: itemsize(dtype_from_name(name)) for name in DTYPE_NAMES}
_FILE_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")
_PREFIX = b'{"zerostall_manifest":"crc32c","body_crc32c":"'
_MID = b'","body":'


@dataclass(frozen=True)
class TensorEntry:
    key: str
    dtype: str
    shape: tuple[int, ...]
    file: str
    offset: int
    nbytes: int
    crc32c: int
    step: int | None = None
    """Set for a reference: the bytes live in ``step-<step>/<file>`` (see :mod:`.refs`)."""

    @classmethod
    def fast(cls, key: str, dtype: str, shape: tuple[int, ...], file: str, offset: int, nbytes: int, crc32c: int,
             step: int | None = None) -> "TensorEntry":
        """The same entry, built without the frozen ``__init__``'s setattr per field (half the
        cost: a save or parse of 1M entries builds 1M)."""
        e = object.__new__(cls)
        e.__dict__.update(key=key, dtype=dtype, shape=shape, file=file, offset=offset, nbytes=nbytes, crc32c=crc32c,
                          step=step)
        return e

    def to_json(self) -> dict[str, Any]:
        out = {"key": self.key, "dtype": self.dtype, "shape": list(self.shape), "file": self.file,
               "offset": self.offset, "nbytes": self.nbytes, "crc32c": self.crc32c}
        if self.step is not None:
            out["step"] = self.step
        return out


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
    ref_files: tuple[RefFile, ...] = ()
    """Earlier steps' shards that entries with ``step`` set live in (incremental saves)."""
    tree_json: str = field(default="", compare=False, repr=False)
    """``tree`` already encoded as compact JSON (the save plan's), spliced in by :meth:`to_bytes`."""
    tensors_json: str = field(default="", compare=False, repr=False)
    """``tensors`` already encoded as a JSON array (:func:`tensors_json`), spliced in by :meth:`to_bytes`."""
    alias_of: dict[int, int] = field(default_factory=dict, compare=False, repr=False)
    """Entries that duplicate an earlier one exactly (index -> first index): read and allocated once."""
    layout: int = field(default_factory=lambda: _layout.WRITE_LAYOUT)
    """The shard layout of this step's own files (:mod:`.layout`; the body's ``alignment``)."""

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

    def body(self, encode_tensors: bool = True) -> dict[str, Any]:
        return {
            "format_version": FORMAT_VERSION_REFS if self.ref_files else self.format_version, "step": self.step, "world_size": self.world_size,
            "checkpoint_id": self.checkpoint_id, "created_unix": self.created_unix,
            "alignment": MANIFEST_ALIGNMENT[self.layout], "checksum": "crc32c",
            "files": [f.to_json() for f in self.files],
            "tensors": [t.to_json() for t in self.tensors] if encode_tensors else None,
            "tree": self.tree, "user_metadata": self.user_metadata,
            **({"rank_trees": list(self.rank_trees)} if self.rank_trees is not None else {}),
            **({"ref_files": [r.to_json() for r in self.ref_files]} if self.ref_files else {}),
        }

    def to_bytes(self) -> bytes:
        """The envelope; the crc32c covers the exact bytes of ``body`` as written."""
        d = self.body(encode_tensors=not self.tensors_json)
        done = {"tree": self.tree_json, "tensors": self.tensors_json}  # encoded before: spliced in
        markers = {}
        for k, v in done.items():
            if v:
                markers[k] = d[k] = f"\x00{k}-{uuid.uuid4().hex}\x00"
        text = json.dumps(d, separators=(",", ":"), allow_nan=False)
        for k, m in markers.items():
            enc = json.dumps(m)
            i = text.index(enc)
            text = text[:i] + done[k] + text[i + len(enc):]
        body = text.encode()
        return b"".join((_PREFIX, f"{_crc.crc32c(body):08x}".encode(), _MID, body, b"}\n"))

    @classmethod
    def from_bytes(cls, raw: bytes, where: str = MANIFEST_NAME) -> "Manifest":
        """Parse and validate; raise :class:`CorruptCheckpoint` naming ``where`` on any defect.

        The whole of :mod:`.validate` runs here, before anyone reads a byte of a shard.
        """

        def bad(msg: str, key: str | None = None) -> CorruptCheckpoint:
            return V.bad(where, msg, key)

        if not isinstance(raw, (bytes, bytearray, memoryview)):
            raise bad(f"manifest is a {type(raw).__name__}, not bytes")
        raw = bytes(raw)
        if len(raw) > MAX_MANIFEST_BYTES:
            raise bad(f"manifest is {len(raw)} bytes, over the {MAX_MANIFEST_BYTES} limit")
        env = V.loads(raw, where)
        if not isinstance(env, dict) or env.get("zerostall_manifest") != "crc32c":
            raise bad("not a zerostall manifest (missing or unknown 'zerostall_manifest' checksum)")
        body = env.get("body")
        if not isinstance(body, dict):
            raise bad("missing body")
        want = env.get("body_crc32c")
        n = len(_PREFIX) + 8 + len(_MID)
        tail = 2 if raw.endswith(b"}\n") else 1
        if raw.startswith(_PREFIX) and raw[len(_PREFIX) + 8:n] == _MID:
            got = f"{_crc.crc32c(raw[n:len(raw) - tail]):08x}"
        else:  # the first envelope: crc32c of the sorted, compact re-encoding of the body
            got = f"{_crc.crc32c(_canonical(body)):08x}"
        if want != got:
            raise bad(f"manifest checksum mismatch (recorded {want!r:.20}, computed {got!r})")
        version = body.get("format_version")
        if version not in (FORMAT_VERSION, FORMAT_VERSION_REFS):
            raise bad(f"unknown format_version {version!r:.40} (this zerostall reads {FORMAT_VERSION} and "
                      f"{FORMAT_VERSION_REFS}; upgrade zerostall to read newer checkpoints)")
        if body.get("checksum") != "crc32c":
            raise bad(f"unknown checksum {body.get('checksum')!r:.40}")
        layouts = {a: v for v, a in MANIFEST_ALIGNMENT.items()}
        layout = layouts.get(body.get("alignment")) if type(body.get("alignment")) is int else None
        if layout is None:
            raise bad(f"unsupported alignment {body.get('alignment')!r:.40} (this zerostall reads "
                      f"{sorted(layouts)}; upgrade zerostall to read newer checkpoints)")

        def integer(obj: dict[str, Any], k: str, lo: int = 0, hi: int = V.MAX_DIM, ctx: str = "") -> int:
            return V.integer(obj, k, where, lo, hi, ctx)

        step = integer(body, "step", 0, V.MAX_STEP)
        world = integer(body, "world_size", 1, 1 << 24)
        cid = body.get("checkpoint_id")
        created = body.get("created_unix")
        if not isinstance(cid, str) or not 0 < len(cid) <= 64:
            raise bad("bad checkpoint_id")
        if type(created) not in (int, float) or not -1e12 < created < 1e12:
            raise bad(f"bad created_unix {created!r:.40}")
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
            ctx = f"file {name!r}: "
            fb = integer(f, "file_bytes", HEADER_BYTES, V.MAX_DIM, ctx)
            if fb % ALIGN_BYTES:
                raise bad(f"{ctx}file_bytes {fb} is not a multiple of {ALIGN_BYTES}")
            host, fid = f.get("host", ""), f.get("file_id", "")
            if not isinstance(fid, str) or len(fid) > 64:
                raise bad(f"{ctx}bad file_id {fid!r:.80}")
            if not isinstance(host, str) or len(host) > 255:
                raise bad(f"{ctx}bad host {host!r:.80}")
            files[name] = FileEntry(name, integer(f, "rank", 0, world - 1, ctx), host, fb, fid)
        refs: dict[tuple[int, str], RefFile] = {}
        if version == FORMAT_VERSION_REFS:
            refs = parse_ref_files(body.get("ref_files"), step, bad)
        elif "ref_files" in body:
            raise bad(f"'ref_files' needs format_version {FORMAT_VERSION_REFS}")
        tensors: list[TensorEntry] = []
        spans: list[V.Span] = []
        # per entry: the common case checked inline (1M entries: a 134 MB manifest), the
        # functions that name what is wrong called only where a check fails
        max_dim, max_key, sizes = V.MAX_DIM, V.MAX_KEY_CHARS, _ITEMSIZE_BY_NAME
        new, fast, span_cls = object.__new__, TensorEntry.fast, V.Span
        for i, t in enumerate(tensors_raw):
            if not isinstance(t, dict):
                raise bad(f"tensor entry {i} is not an object")
            key = t.get("key")
            if not isinstance(key, str) or len(key) > max_key:
                raise bad(f"tensor entry {i} has no valid key")
            dt = t.get("dtype")
            size = sizes.get(dt) if type(dt) is str else None
            if size is None:
                dtype_from_name(dt, where=f"{where}: tensor {key!r}")  # raises: unknown
            nbytes = t.get("nbytes")
            if type(nbytes) is not int or not 0 <= nbytes <= max_dim:
                nbytes = integer(t, "nbytes", 0, max_dim, f"tensor {key!r}: ")  # raises
            shape = t.get("shape")
            if type(shape) is list and not shape and nbytes == size:
                shape = ()
            elif (type(shape) is list and len(shape) == 1 and type(shape[0]) is int and 0 <= shape[0] < max_dim
                  and shape[0] * size == nbytes):
                shape = (shape[0],)
            else:
                shape = V.check_shape(shape, size, nbytes, where, key)
            fname = t.get("file")
            ref_step = t.get("step")
            span_file = fname
            if ref_step is not None:  # a reference (format version 2): bytes in an earlier step's file
                if not isinstance(fname, str) or type(ref_step) is not int or (ref_step, fname) not in refs:
                    raise bad(f"tensor {key!r}: step-{ref_step!r:.20}/{fname!r:.80} is not listed in 'ref_files'", key)
                span_file = f"step-{ref_step}/{fname}"
            elif not isinstance(fname, str) or fname not in files:
                raise bad(f"tensor {key!r}: file {fname!r:.80} is not listed in 'files'", key)
            off, crc = t.get("offset"), t.get("crc32c")
            if type(off) is not int or not 0 <= off <= max_dim:
                off = integer(t, "offset", 0, max_dim, f"tensor {key!r}: ")  # raises
            if type(crc) is not int or not 0 <= crc <= 0xFFFFFFFF:
                crc = integer(t, "crc32c", 0, 0xFFFFFFFF, f"tensor {key!r}: ")  # raises
            tensors.append(fast(key, dt, shape, fname, off, nbytes, crc, ref_step))
            s = new(span_cls)
            s.__dict__.update(index=i, file=span_file, offset=off, nbytes=nbytes, ident=(dt, shape, crc), key=key)
            spans.append(s)
        alias = V.check_spans(spans, {**{f.name: f.file_bytes for f in files.values()},
                                      **{f"step-{r.step}/{r.name}": r.file_bytes for r in refs.values()}}, where,
                              layout)
        rank_trees = body.get("rank_trees")
        if rank_trees is not None and (not isinstance(rank_trees, list) or len(rank_trees) != world):
            raise bad("'rank_trees' must list one tree per rank")
        dtypes = [t.dtype for t in tensors]
        for tree in [body.get("tree")] + (rank_trees or []):
            V.check_tree_refs(tree_tensor_indices(tree), dtypes, where)
            decode_tree(tree, [None] * len(tensors), where=where,  # structure only: unknown tags fail here
                        build_objects=False)
        meta = body.get("user_metadata", {})
        if not isinstance(meta, dict):
            raise bad("'user_metadata' is not an object")
        return cls(step=step, world_size=world, checkpoint_id=cid, created_unix=float(created),
                   files=tuple(files.values()), tensors=tuple(tensors), tree=body.get("tree"),
                   user_metadata=meta, format_version=version,
                   rank_trees=tuple(rank_trees) if rank_trees is not None else None, alias_of=alias,
                   ref_files=tuple(refs.values()), layout=layout)


_CRC_TAIL = ',"crc32c":'
_CRC_FMT = _CRC_TAIL + "{}}}"


def tensors_json(tensors: tuple[TensorEntry, ...], memo: dict[Any, Any] | None = None) -> str:
    """``tensors`` (entries without references) as the manifest's JSON array, exactly as
    :meth:`Manifest.to_bytes` would encode them. Everything but the crc32c depends on the
    layout only: with ``memo`` (the save plan's, shared by every save of one layout), the
    array is encoded once with placeholders and each later save only joins in its crc32c
    values (C-level ``str.join``/``map``: ~0.5 s less on the persist thread at 100k tensors).
    Persist thread."""
    written = isinstance(tensors, Entries)
    if not written and any(t.step is not None for t in tensors):
        raise ValueError("tensors_json: references are encoded by Manifest.to_bytes")
    key = ("tensors_json", len(tensors), tensors.file if written else tensors[0].file if tensors else "")
    parts = memo.get(key) if memo is not None else None
    if parts is None and written:  # from the plan's items: no entry object, no dict per entry
        parts = tensors.json_parts()
        if memo is not None:
            memo[key] = parts
    if parts is None:
        entries = [t.to_json() for t in tensors]
        for e in entries:
            e["crc32c"] = 0
        blank = json.dumps(entries, separators=(",", ":"), allow_nan=False)
        # every object ends with its crc32c; a key's own '"' is escaped, so the marker
        # cannot occur inside a string
        parts = blank.split(_CRC_TAIL + "0}")
        if len(parts) != len(tensors) + 1:
            raise ValueError("tensors_json: an entry's JSON did not end with its crc32c")
        if memo is not None:
            memo[key] = parts
    crcs = map(_CRC_FMT.format, tensors.crcs if written else map(_crc_of, tensors))
    return "".join(map(str.__add__, parts, crcs)) + parts[-1]  # map stops at the shorter: n pairs


class Entries(Sequence[TensorEntry]):
    """The tensor entries of one written shard, kept as the save plan's items (anything with
    ``key``, ``dtype``, ``shape``, ``offset``, ``nbytes``), the shard's name and the crc32c
    values: a :class:`TensorEntry` is made only on access. The single-rank committer's manifest
    (persist thread): making 100k entries per save cost ~0.7 s, and :func:`tensors_json`
    encodes these without them. Immutable; compares like the tuple of its entries."""

    __slots__ = ("items", "file", "crcs")

    def __init__(self, items: Sequence[Any], file: str, crcs: Sequence[int]):
        if len(items) != len(crcs):
            raise ValueError(f"{len(items)} items but {len(crcs)} crc32c values")
        self.items, self.file, self.crcs = items, file, crcs

    def __len__(self) -> int:
        return len(self.items)

    def __getitem__(self, i: Any) -> Any:
        if isinstance(i, slice):
            return tuple(self)[i]
        it = self.items[i]
        return TensorEntry(it.key, it.dtype, tuple(it.shape), self.file, it.offset, it.nbytes, self.crcs[i])

    def __iter__(self) -> Iterator[TensorEntry]:
        return map(self.__getitem__, range(len(self.items)))

    def __eq__(self, other: Any) -> bool:
        return isinstance(other, (tuple, Entries)) and tuple(self) == tuple(other)

    def __hash__(self) -> int:
        return hash(tuple(self))

    def json_parts(self) -> list[str]:
        """The entries' JSON with each crc32c cut out (see :func:`tensors_json`)."""
        dumps, f = json.dumps, json.dumps(self.file)
        dt = {d: dumps(d) for d in {it.dtype for it in self.items}}
        objs = [f'{{"key":{dumps(it.key)},"dtype":{dt[it.dtype]},"shape":[{",".join(map(str, it.shape))}],'
                f'"file":{f},"offset":{it.offset},"nbytes":{it.nbytes}' for it in self.items]
        if not objs:
            return ["[]"]
        return ["[" + objs[0]] + ["," + o for o in objs[1:]] + ["]"]


_crc_of = operator.attrgetter("crc32c")


def _canonical(body: Any) -> bytes:
    return json.dumps(body, sort_keys=True, separators=(",", ":"), allow_nan=False).encode()


