"""Look inside DCP checkpoint directories (zerostall.dcp and FileSystemWriter): list, verify, describe.

Used by the CLI (``zerostall ls/verify/inspect`` on a directory holding ``.metadata``) from
the caller's thread. Reads only; every ``.metadata`` goes through :mod:`.dcp_meta`'s
validation first. ``verify`` reads every byte of a zerostall.dcp checkpoint through the
shard codec (header, crc32c, padding); FileSystemWriter checkpoints carry no checksums, so
for them it checks the structure and that every tensor loads with ``weights_only=True``.
"""

from __future__ import annotations

import io
import os
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.distributed.checkpoint.metadata import BytesStorageMetadata, Metadata

from ..config import IOConfig
from ..errors import CorruptCheckpoint
from ..format.layout import ShardHeader
from ..format.shard import read_shard
from ..memory.arena import Arena
from .dcp_meta import Record, read_metadata_file, validate
from .dcp_files import METADATA
from .dcp_writer import WINDOW_BYTES, _io_engine

KIND_NAMES = {"zerostall": "zerostall.dcp", "filesystem": "FileSystemWriter"}


@dataclass
class DcpInfo:
    """One validated metadata file of a DCP checkpoint, summarised."""

    metadata: str
    kind: str
    entries: list[dict[str, Any]] = field(default_factory=list)
    files: list[str] = field(default_factory=list)
    total_bytes: int = 0
    save_id: str = ""

    @property
    def kind_name(self) -> str:
        return KIND_NAMES.get(self.kind, self.kind)


def describe(path: str, name: str = METADATA) -> DcpInfo:
    where = os.path.join(path, name)
    md = read_metadata_file(where)
    kind, records = validate(md, where, path)
    return _summary(where, kind, md, records)


def _summary(where: str, kind: str, md: Metadata, records: dict[Any, Record]) -> DcpInfo:
    info = DcpInfo(where, kind, save_id=str(getattr(md.storage_meta, "save_id", "") or ""))
    for fqn, entry in md.state_dict_metadata.items():
        if isinstance(entry, BytesStorageMetadata):
            info.entries.append({"key": fqn, "type": "object", "dtype": "", "shape": [], "chunks": 1})
        else:
            dtype = str(entry.properties.dtype).replace("torch.", "")
            info.entries.append({"key": fqn, "type": "tensor", "dtype": dtype,
                                 "shape": list(entry.size), "chunks": len(entry.chunks)})
    info.files = sorted({r.file for r in records.values()})
    info.total_bytes = sum(r.nbytes for r in records.values())
    return info


def verify(path: str, name: str = METADATA, io_cfg: IOConfig | None = None) -> DcpInfo:
    """Check every byte (zerostall.dcp) or every record (FileSystemWriter); raise CorruptCheckpoint."""
    where = os.path.join(path, name)
    md = read_metadata_file(where)
    kind, records = validate(md, where, path)
    by_file: dict[str, list[tuple[Record, Any]]] = {}
    for k, r in records.items():
        by_file.setdefault(r.file, []).append((r, md.storage_data[k]))
    if kind == "zerostall":
        largest = max((v.file_bytes for rs in by_file.values() for _, v in rs), default=4096)
        bounce = Arena(min(WINDOW_BYTES, largest), mlock=False, prefault=False)
        eng = _io_engine(path, io_cfg)
        try:
            for fname, rs in by_file.items():
                rs.sort(key=lambda rv: rv[0].offset)
                v0 = rs[0][1]
                with eng.open_read(os.path.join(path, fname)) as f:
                    read_shard(f, os.path.join(path, fname), v0.file_bytes,
                               ShardHeader(v0.file_id, 0, v0.rank, v0.file_bytes), [r for r, _ in rs],
                               [None] * len(rs), bounce)
        finally:
            eng.close()
            bounce.close()
    else:
        for fname, rs in by_file.items():
            fpath = os.path.join(path, fname)
            with open(fpath, "rb") as f:
                for r, _ in rs:
                    f.seek(r.offset)
                    raw = f.read(r.nbytes)
                    try:
                        torch.load(io.BytesIO(raw), map_location="cpu", weights_only=True)
                    except Exception as exc:  # noqa: BLE001 - reported as corruption
                        raise CorruptCheckpoint(f"{fpath}: {r.key!r} does not load under weights_only "
                                                f"({type(exc).__name__}: {str(exc)[:160]})",
                                                path=fpath, key=r.key) from None
    return _summary(where, kind, md, records)
