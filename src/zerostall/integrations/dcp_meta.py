"""DCP ``.metadata``: read without running code, and validate before anything is allocated.

:func:`read_metadata_file` opens it as a bounded regular file and unpickles it with an
allow-list of the classes DCP's metadata is made of; :func:`validate` checks every field a
reader uses (types, ranges, shapes against byte counts, dtypes, file names inside the
checkpoint, records inside their files and not overlapping). Every failure is a
:class:`~zerostall.errors.CorruptCheckpoint` naming the file and the field. Validation is
linear in the file's size however the pickle shares objects (docs/speed-tricks.md).

Called from the caller's thread (``Reader.read_metadata``, the CLI); no state.
"""

from __future__ import annotations

import io
import math
import os
import pickle
import re
import stat
from dataclasses import dataclass
from typing import Any

import torch
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.metadata import (BytesStorageMetadata, ChunkStorageMetadata, Metadata,
                                                   MetadataIndex, TensorStorageMetadata)

from ..config import ALIGN_BYTES
from ..errors import CheckpointNotFound, CorruptCheckpoint
from ..format.dtypes import SUPPORTED_DTYPES, dtype_from_name, dtype_name
from ..format.layout import HEADER_BYTES, item_align
from ..format.shard import check_items
from ..format.validate import read_small
from .dcp_writer import SHARD_RE, UnsupportedCheckpoint, _ZSInfo

MAX_METADATA_BYTES = 256 << 20
MAX_RECORDS = 1 << 24  # storage records one .metadata may hold (DCP writes one per chunk of every rank)
_MAX_DIM = 1 << 62
_FSW_FILE_RE = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9._-]{0,254}$")

_ALLOWED = {
    ("torch.distributed.checkpoint.metadata", n) for n in (
        "BytesStorageMetadata", "ChunkStorageMetadata", "Metadata", "MetadataIndex", "StorageMeta",
        "TensorProperties", "TensorStorageMetadata", "_MEM_FORMAT_ENCODING")
} | {
    ("torch.distributed._shard.sharded_tensor.metadata", "TensorProperties"),
    ("torch.distributed._shard.sharded_tensor.metadata", "MEM_FORMAT_ENCODING"),
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
    ("torch", "Size"), ("torch.serialization", "_get_layout"), ("pathlib", "PosixPath"),
    ("collections", "OrderedDict"), ("zerostall.integrations.dcp_writer", "_ZSInfo"),
}
"""Every class DCP's metadata (ours and FileSystemWriter's) is made of; nothing else."""


class _SafeUnpickler(pickle.Unpickler):
    """Resolves only the allow-listed classes and torch dtypes; anything else is refused."""

    def __init__(self, data: bytes, where: str):
        super().__init__(io.BytesIO(data))
        self.where = where

    def find_class(self, module: str, name: str) -> Any:
        # vars(), not getattr: torch's module __getattr__ imports submodules (torch._inductor)
        if (module, name) in _ALLOWED or (module == "torch" and isinstance(vars(torch).get(name), torch.dtype)):
            return super().find_class(module, name)
        if module.startswith("zerostall."):
            raise CorruptCheckpoint(f"{self.where}: DCP metadata refers to {module}.{name}: written by an earlier "
                                    "zerostall; load it with that zerostall and save it again", path=self.where)
        raise CorruptCheckpoint(f"{self.where}: DCP metadata refers to {module}.{name}, which DCP checkpoint "
                                "metadata never contains; refusing to unpickle it", path=self.where)


@dataclass(frozen=True)
class Record:
    """One validated storage record, in the codec's terms (``key`` names it in errors)."""

    key: str
    file: str
    offset: int
    nbytes: int
    crc32c: int


def read_metadata_file(path: str) -> Metadata:
    """Read ``path`` (a regular file, bounded), unpickle it safely; raise CheckpointNotFound/CorruptCheckpoint."""
    try:
        raw = read_small(path, MAX_METADATA_BYTES)  # a FIFO, directory or symlink: CorruptCheckpoint
    except FileNotFoundError:
        raise CheckpointNotFound(f"no DCP checkpoint at {os.path.dirname(path)!r} "
                                 f"({os.path.basename(path)} missing)") from None
    except OSError as exc:
        raise CorruptCheckpoint(f"{path}: cannot read DCP metadata ({os.strerror(exc.errno or 0)})",
                                path=path) from None
    try:
        md = _SafeUnpickler(raw, path).load()
    except CorruptCheckpoint:
        raise
    except Exception as exc:  # noqa: BLE001 - any decoding failure is corruption
        raise CorruptCheckpoint(f"{path}: unreadable DCP metadata ({type(exc).__name__}: {str(exc)[:200]})",
                                path=path) from None
    if not isinstance(md, Metadata):
        raise CorruptCheckpoint(f"{path}: not DCP metadata (a {type(md).__name__})", path=path)
    return md


def _int(v: Any, where: str, field: str, lo: int = 0, hi: int = _MAX_DIM) -> int:
    if type(v) is not int or not lo <= v <= hi:
        raise CorruptCheckpoint(f"{where}: {field} is {v!r:.80}, not an integer in [{lo}, {hi}]", path=where)
    return v


def _shape(v: Any, where: str, field: str) -> tuple[int, ...]:
    if not isinstance(v, (tuple, list)) or len(v) > 64:
        raise CorruptCheckpoint(f"{where}: {field} is {v!r:.80}, not a shape", path=where)
    return tuple(_int(d, where, f"{field}[{i}]") for i, d in enumerate(v))


def validate(md: Metadata, where: str, root: str) -> tuple[str, dict[MetadataIndex, Record]]:
    """Check every field of ``md`` (read from ``where``) and its files under ``root``; return the
    kind (``"zerostall"``, or ``"filesystem"`` for FileSystemWriter's) and the records in codec
    terms. Raises :class:`CorruptCheckpoint` (:class:`UnsupportedCheckpoint`: a valid
    FileSystemWriter checkpoint this reader cannot read)."""
    if not isinstance(md.state_dict_metadata, dict):
        raise CorruptCheckpoint(f"{where}: state_dict_metadata is {type(md.state_dict_metadata).__name__}, "
                                "not a dict", path=where)
    if not isinstance(md.storage_data, dict):
        raise CorruptCheckpoint(f"{where}: storage_data is {type(md.storage_data).__name__}, not a dict", path=where)
    kinds = {type(v) for v in md.storage_data.values()}
    if kinds <= {_ZSInfo}:
        kind = "zerostall"
    elif kinds == {_StorageInfo}:
        kind = "filesystem"
    else:
        raise CorruptCheckpoint(f"{where}: DCP metadata mixes storage records of "
                                f"{sorted(k.__name__ for k in kinds)}; not a checkpoint this reader knows", path=where)
    # the chunks walked are bounded by the records too: a chunk that validates uses a record no
    # other chunk uses (_check_entry), so at most one more chunk than records is ever walked
    if len(md.storage_data) > MAX_RECORDS:
        raise CorruptCheckpoint(f"{where}: {len(md.storage_data)} storage records, over the limit of {MAX_RECORDS}",
                                path=where)
    for k in md.storage_data:
        if not isinstance(k, MetadataIndex) or not isinstance(k.fqn, str):
            raise CorruptCheckpoint(f"{where}: storage_data key {k!r:.80} is not a MetadataIndex", path=where)
    records = {k: (_zs_record if kind == "zerostall" else _fs_record)(k, v, where)
               for k, v in md.storage_data.items()}
    for fqn, entry in md.state_dict_metadata.items():
        _check_entry(fqn, entry, md.storage_data, kind, where)
    _check_files(records, md.storage_data, kind, where, root)
    return kind, records


def _zs_record(k: MetadataIndex, v: _ZSInfo, where: str) -> Record:
    f = f"storage record {k.fqn!r}"
    if not isinstance(v.file, str) or not SHARD_RE.match(v.file):
        raise CorruptCheckpoint(f"{where}: {f}.file is {v.file!r:.80}, not a shard file name (rank-NNNNN.shard; an "
                                "earlier zerostall's .zst: load it with that zerostall and save it again)", path=where)
    file_bytes = _int(v.file_bytes, where, f"{f}.file_bytes", HEADER_BYTES)
    if file_bytes % ALIGN_BYTES:
        raise CorruptCheckpoint(f"{where}: {f}.file_bytes {file_bytes} is not a multiple of {ALIGN_BYTES}", path=where)
    offset = _int(v.offset, where, f"{f}.offset", HEADER_BYTES)
    nbytes = _int(v.nbytes, where, f"{f}.nbytes")
    if offset % item_align(nbytes) or offset + nbytes > file_bytes:  # format/layout.py
        raise CorruptCheckpoint(f"{where}: {f}: offset {offset} + nbytes {nbytes} is unaligned or past the "
                                f"{file_bytes}-byte file", path=where)
    crc = _int(v.crc32c, where, f"{f}.crc32c", 0, 0xFFFFFFFF)
    _int(v.rank, where, f"{f}.rank", 0, 1 << 31)
    if not isinstance(v.file_id, str) or len(v.file_id) > 256:
        raise CorruptCheckpoint(f"{where}: {f}.file_id is {v.file_id!r:.80}, not an id", path=where)
    shape = _shape(v.shape, where, f"{f}.shape")
    if not isinstance(v.dtype, str):
        raise CorruptCheckpoint(f"{where}: {f}.dtype is {v.dtype!r:.80}", path=where)
    if v.dtype == "":
        if shape != (nbytes,):
            raise CorruptCheckpoint(f"{where}: {f}: an object of {nbytes} bytes has shape {list(shape)}", path=where)
    else:
        dt = dtype_from_name(v.dtype, f"{where}: {f}.dtype")
        if math.prod(shape) * dt.itemsize != nbytes:
            raise CorruptCheckpoint(f"{where}: {f}: shape {list(shape)} of {v.dtype} is not {nbytes} bytes",
                                    path=where)
    return Record(k.fqn, v.file, offset, nbytes, crc)


def _fs_record(k: MetadataIndex, v: Any, where: str) -> Record:
    f = f"storage record {k.fqn!r}"
    rel = getattr(v, "relative_path", None)
    if not isinstance(rel, str) or not _FSW_FILE_RE.match(rel) or rel.endswith(".metadata"):
        raise CorruptCheckpoint(f"{where}: {f}.relative_path is {rel!r:.80}, not a file name inside the "
                                "checkpoint", path=where)
    offset = _int(getattr(v, "offset", None), where, f"{f}.offset")
    length = _int(getattr(v, "length", None), where, f"{f}.length")
    td = getattr(v, "transform_descriptors", None)
    if td:
        raise UnsupportedCheckpoint(
            f"{where}: {f} was written by FileSystemWriter with stream extensions {list(td)!r:.120}; "
            "zerostall.dcp.Reader reads plain FileSystemWriter checkpoints only: load this one with "
            "torch.distributed.checkpoint.FileSystemReader", path=where)
    return Record(k.fqn, rel, offset, length, 0)


def _check_entry(fqn: Any, entry: Any, storage: dict[MetadataIndex, Any], kind: str, where: str) -> None:
    if not isinstance(fqn, str):
        raise CorruptCheckpoint(f"{where}: state_dict_metadata key {fqn!r:.80} is not a string", path=where)
    f = f"state_dict_metadata[{fqn!r}]"
    if isinstance(entry, BytesStorageMetadata):
        v = storage.get(MetadataIndex(fqn))
        if v is None:
            raise CorruptCheckpoint(f"{where}: {f} has no storage record", path=where)
        if kind == "zerostall" and v.dtype != "":
            raise CorruptCheckpoint(f"{where}: {f} is an object but its record holds a {v.dtype} tensor", path=where)
        return
    if not isinstance(entry, TensorStorageMetadata):
        raise CorruptCheckpoint(f"{where}: {f} is a {type(entry).__name__}", path=where)
    size = _shape(entry.size, where, f"{f}.size")
    dtype = getattr(entry.properties, "dtype", None)
    if not isinstance(dtype, torch.dtype):
        raise CorruptCheckpoint(f"{where}: {f}.properties.dtype is {dtype!r:.80}", path=where)
    if not isinstance(entry.chunks, list):
        raise CorruptCheckpoint(f"{where}: {f}.chunks is not a list", path=where)
    seen: set[tuple[int, ...]] = set()
    for i, c in enumerate(entry.chunks):
        if not isinstance(c, ChunkStorageMetadata):
            raise CorruptCheckpoint(f"{where}: {f}.chunks[{i}] is a {type(c).__name__}", path=where)
        offs = _shape(c.offsets, where, f"{f}.chunks[{i}].offsets")
        if offs in seen:
            raise CorruptCheckpoint(f"{where}: {f}.chunks[{i}] repeats the offsets {list(offs)} of an earlier chunk",
                                    path=where)
        seen.add(offs)
        sizes = _shape(c.sizes, where, f"{f}.chunks[{i}].sizes")
        if len(offs) != len(size) or len(sizes) != len(size) or any(o + s > d for o, s, d in zip(offs, sizes, size)):
            raise CorruptCheckpoint(f"{where}: {f}.chunks[{i}] (offsets {list(offs)}, sizes {list(sizes)}) does not "
                                    f"fit the tensor's size {list(size)}", path=where)
        v = storage.get(MetadataIndex(fqn, offs))
        if v is None:
            raise CorruptCheckpoint(f"{where}: {f}.chunks[{i}] has no storage record", path=where)
        if kind == "zerostall":
            if dtype not in SUPPORTED_DTYPES or v.dtype != dtype_name(dtype):
                raise CorruptCheckpoint(f"{where}: {f} is {dtype} but its record holds {v.dtype!r:.40}", path=where)
            if tuple(v.shape) != sizes:
                raise CorruptCheckpoint(f"{where}: {f}.chunks[{i}] is {list(sizes)} but its record holds shape "
                                        f"{list(v.shape)}", path=where)


def _check_files(records: dict[MetadataIndex, Record], storage: dict[MetadataIndex, Any], kind: str,
                 where: str, root: str) -> None:
    """Every file is a regular file inside ``root`` of the size the records say; records fit and don't overlap."""
    by_file: dict[str, list[Record]] = {}
    sizes: dict[str, int] = {}
    for k, r in records.items():
        by_file.setdefault(r.file, []).append(r)
        if kind == "zerostall":
            fb = storage[k].file_bytes
            if sizes.setdefault(r.file, fb) != fb:
                raise CorruptCheckpoint(f"{where}: records of {r.file} disagree on its size ({sizes[r.file]} vs {fb})",
                                        path=where)
    for name, recs in by_file.items():
        path = os.path.join(root, name)
        try:
            st = os.lstat(path)
        except FileNotFoundError:
            raise CorruptCheckpoint(f"{path}: file is missing (named by {where})", path=path) from None
        except OSError as exc:
            raise CorruptCheckpoint(f"{path}: cannot stat ({os.strerror(exc.errno or 0)})", path=path) from None
        if not stat.S_ISREG(st.st_mode):
            raise CorruptCheckpoint(f"{path}: not a regular file (symlink, FIFO or directory)", path=path)
        recs.sort(key=lambda r: (r.offset, r.nbytes))
        if kind == "zerostall":
            if st.st_size != sizes[name]:
                raise CorruptCheckpoint(f"{path}: shard is {st.st_size} bytes, {where} says {sizes[name]} "
                                        "(truncated or replaced)", path=path)
            check_items(path, recs, st.st_size)
        else:
            end = 0
            for r in recs:
                if r.offset < end or r.offset + r.nbytes > st.st_size:
                    raise CorruptCheckpoint(f"{path}: record {r.key!r} (offset {r.offset}, length {r.nbytes}) overlaps "
                                            f"another or lies outside the {st.st_size}-byte file", path=path, key=r.key)
                end = r.offset + r.nbytes
