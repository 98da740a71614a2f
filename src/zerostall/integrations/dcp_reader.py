"""A ``torch.distributed.checkpoint`` storage reader for zerostall.dcp and (plain,
``torch_save``) FileSystemWriter checkpoints, and what ``zerostall ls/verify/inspect`` show of
them (:func:`describe`, :func:`verify`; the CLI's thread). docs/dcp.md says what it reads.

``read_metadata`` goes through :mod:`.dcp_meta` before anything is allocated. zerostall.dcp
shards are read through :func:`zerostall.format.shard.read_shard` (crc32c and padding checked,
only the items this rank needs). DCP's planner unpickles ``BYTE_IO`` items with
``weights_only=False``: each must first load under ``weights_only=True``, so loading never
runs code.

Call order (DCP's): ``reset`` -> ``read_metadata`` -> ``set_up_storage_reader`` ->
``prepare_local_plan`` -> ``prepare_global_plan`` (coordinator) -> ``read_data`` (every rank).
One Reader serves one load at a time.
"""

from __future__ import annotations

import io
import os
import uuid
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.distributed._shard._utils import narrow_tensor_by_index
from torch.distributed.checkpoint.metadata import BytesStorageMetadata, Metadata, MetadataIndex, StorageMeta
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan, LoadPlanner, ReadItem
from torch.distributed.checkpoint.storage import StorageReader
from torch.futures import Future

from ..config import IOConfig
from ..errors import CheckpointNotFound, CorruptCheckpoint
from ..format.dtypes import dtype_from_name
from ..format.layout import ShardHeader
from ..format.shard import read_shard
from ..format.validate import open_regular
from ..memory.arena import Arena
from ..store.files import open_shard_checked
from .dcp_meta import Record, read_metadata_file, validate
from .dcp_writer import METADATA, CheckpointId, UnsupportedCheckpoint, _ZSInfo, metadata_name, shard_io


def _by_file(records: dict[MetadataIndex, Record],
             storage: dict[MetadataIndex, Any]) -> dict[str, list[tuple[Record, Any]]]:
    """Each file's (record, storage record) pairs, in file order."""
    out: dict[str, list[tuple[Record, Any]]] = {}
    for k, r in records.items():
        out.setdefault(r.file, []).append((r, storage[k]))
    for entries in out.values():
        entries.sort(key=lambda rv: rv[0].offset)
    return out


def _safe_load(path: str, key: str, raw: bytes) -> Any:
    """``torch.load(raw, weights_only=True)``; anything it refuses is a CorruptCheckpoint."""
    try:
        return torch.load(io.BytesIO(raw), map_location="cpu", weights_only=True)
    except Exception as exc:  # noqa: BLE001 - anything torch.load refuses is corruption here
        raise CorruptCheckpoint(f"{path}: {key!r} does not load under weights_only, so it cannot be loaded without "
                                f"running code ({type(exc).__name__}: {str(exc)[:200]})", path=path, key=key) from None


class Reader(CheckpointId, StorageReader):
    """``FileSystemReader``'s drop-in: ``dcp.load(sd, storage_reader=Reader(path))``.
    ``verify=False`` skips crc32c and padding checks (metadata validation always runs)."""

    def __init__(self, path: str | os.PathLike[str], *, io: IOConfig | None = None, verify: bool = True):
        super().__init__()
        self._set_id(path)
        self.io = io
        self.verify = verify
        self.kind = "zerostall"
        self.rank: int | None = None
        self.use_collectives = True
        self.reset()

    def reset(self, checkpoint_id: str | os.PathLike[str] | None = None) -> None:
        self.storage_data: dict[MetadataIndex, Any] = {}
        self.records: dict[MetadataIndex, Record] = {}
        if checkpoint_id:
            self._set_id(checkpoint_id)
        self.load_id = uuid.uuid4().hex

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        rank = kwargs.get("rank")
        where = os.path.join(self.path, metadata_name(rank, rank is None))
        if rank is not None and not os.path.lexists(where) and os.path.lexists(os.path.join(self.path, METADATA)):
            # DCP asks for rank-local metadata after the global one failed: report why that failed
            where = os.path.join(self.path, METADATA)
        try:
            md = read_metadata_file(where)
        except CheckpointNotFound:
            if any(os.path.lexists(os.path.join(self.path, n)) for n in ("manifest.json", "latest")):
                raise CheckpointNotFound(f"{self.path!r} is a zerostall Checkpointer directory, not a DCP checkpoint: "
                                         "load it with zerostall.load(path) or Checkpointer(path).load()") from None
            raise
        self.kind, self.records = validate(md, where, self.path)
        if getattr(md, "storage_meta", None) is None:
            md.storage_meta = StorageMeta()
        md.storage_meta.load_id = self.load_id
        return md

    def set_up_storage_reader(self, metadata: Metadata, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        self.storage_data = metadata.storage_data
        self.rank = kwargs.get("rank")
        self.use_collectives = kwargs.get("use_collectives", True)
        if not self.records:  # metadata that did not come from our read_metadata
            where = os.path.join(self.path, metadata_name(self.rank, self.use_collectives))
            self.kind, self.records = validate(metadata, where, self.path)

    def prepare_local_plan(self, plan: LoadPlan) -> LoadPlan:
        return plan

    def prepare_global_plan(self, plans: list[LoadPlan]) -> list[LoadPlan]:
        return plans

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        per_file: dict[str, list[ReadItem]] = {}
        for req in plan.items:
            rec = self.records.get(req.storage_index)
            if rec is None:
                raise CorruptCheckpoint(f"{self.path}: no storage record for {req.storage_index.fqn!r}",
                                        path=self.path, key=req.storage_index.fqn)
            per_file.setdefault(rec.file, []).append(req)
        if self.kind == "zerostall":
            self._read_zerostall(per_file, planner)
        else:
            for fname, reqs in per_file.items():
                self._read_filesystem(fname, reqs, planner)
        fut: Future[None] = Future()
        fut.set_result(None)
        return fut

    # -- zerostall.dcp checkpoints -----------------------------------------------------------
    def _read_zerostall(self, per_file: dict[str, list[ReadItem]], planner: LoadPlanner) -> None:
        if not per_file:
            return
        all_by_file = _by_file(self.records, self.storage_data)
        largest = max(self.storage_data[reqs[0].storage_index].file_bytes for reqs in per_file.values())
        with shard_io(self.path, self.io, largest, prefault=False) as (eng, bounce):
            for fname, reqs in per_file.items():
                self._read_shard(eng, bounce, fname, reqs, all_by_file[fname], planner)

    def _read_shard(self, eng: Any, bounce: Arena, fname: str, reqs: list[ReadItem],
                    entries: list[tuple[Record, _ZSInfo]], planner: LoadPlanner) -> None:
        path = os.path.join(self.path, fname)
        items = [r for r, _ in entries]
        pos = {(r.offset, r.nbytes, r.key): i for i, r in enumerate(items)}
        wanted: dict[int, list[ReadItem]] = {}
        for req in reqs:
            r = self.records[req.storage_index]
            wanted.setdefault(pos[(r.offset, r.nbytes, r.key)], []).append(req)
        scratch: dict[int, torch.Tensor] = {}  # items in flight only: bounded by the window + one item
        direct: dict[int, torch.Tensor] = {}  # items read straight into the planner's tensor
        info0 = entries[0][1]

        def dst(i: int) -> torch.Tensor:
            target = self._direct_target(wanted.get(i, []), entries[i][1], planner)
            if target is not None:
                direct[i] = target
                return target.reshape(-1).view(torch.uint8)
            scratch[i] = torch.empty(items[i].nbytes, dtype=torch.uint8)
            return scratch[i]

        def deliver(i: int) -> None:
            if i in direct:  # the bytes are in place and passed their crc32c
                planner.commit_tensor(wanted[i][0], direct.pop(i))
                return
            data = scratch.pop(i) if i in scratch else torch.empty(0, dtype=torch.uint8)  # empty: none read
            for req in wanted.get(i, ()):
                if req.type == LoadItemType.BYTE_IO:
                    self._load_bytes(path, req, data.numpy().tobytes(), planner)
                else:
                    info = entries[i][1]
                    t = data.view(dtype_from_name(info.dtype, path)).reshape(info.shape)
                    self._load_tensor(path, req, t, planner)

        with open_shard_checked(eng, path) as f:
            read_shard(f, path, info0.file_bytes, ShardHeader(info0.file_id, 0, info0.rank, info0.file_bytes),
                       items, dst, bounce, verify=self.verify, wanted=set(wanted), on_item=deliver,
                       listed=True)  # every record of the file: all padding read is checked

    @staticmethod
    def _direct_target(reqs: list[ReadItem], info: _ZSInfo, planner: LoadPlanner) -> torch.Tensor | None:
        """The planner's tensor when one request takes a whole stored tensor into a matching
        contiguous CPU tensor (the common case): the codec reads into it, saving a copy."""
        if len(reqs) != 1 or reqs[0].type == LoadItemType.BYTE_IO or not info.dtype:
            return None
        req = reqs[0]
        if any(req.storage_offsets) or tuple(req.lengths) != tuple(info.shape):
            return None
        target = planner.resolve_tensor(req).detach()
        if target.device.type != "cpu" or not target.is_contiguous() or tuple(target.shape) != tuple(info.shape) \
                or target.dtype != dtype_from_name(info.dtype) or target.numel() == 0:
            return None
        return target

    # -- FileSystemWriter checkpoints (read-only) -------------------------------------------
    def _read_filesystem(self, fname: str, reqs: list[ReadItem], planner: LoadPlanner) -> None:
        path = os.path.join(self.path, fname)
        try:
            fd = open_regular(path)  # a symlink, FIFO or directory: CorruptCheckpoint
        except OSError as exc:
            raise CorruptCheckpoint(f"{path}: cannot open ({os.strerror(exc.errno or 0)})", path=path) from None
        try:
            for req in sorted(reqs, key=lambda q: self.records[q.storage_index].offset):
                rec = self.records[req.storage_index]
                raw = os.pread(fd, rec.nbytes, rec.offset)
                if len(raw) != rec.nbytes:
                    raise CorruptCheckpoint(f"{path}: {rec.key!r} is cut short (file truncated)",
                                            path=path, key=rec.key)
                if req.type == LoadItemType.BYTE_IO:
                    self._load_bytes(path, req, raw, planner)
                    continue
                if not raw.startswith(b"PK\x03\x04"):
                    raise UnsupportedCheckpoint(
                        f"{path}: tensor {rec.key!r} is not a torch.save stream: the checkpoint was written by "
                        "FileSystemWriter with serialization_format=SAFETENSORS (raw bytes), which neither "
                        "FileSystemReader nor zerostall.dcp.Reader reads", path=path, key=rec.key)
                t = _safe_load(path, rec.key, raw)
                if not isinstance(t, torch.Tensor):
                    raise CorruptCheckpoint(f"{path}: {rec.key!r} holds a {type(t).__name__}, not a tensor",
                                            path=path, key=rec.key)
                self._load_tensor(path, req, t, planner)
        finally:
            os.close(fd)

    # -- both ---------------------------------------------------------------------------------
    def _load_bytes(self, path: str, req: ReadItem, raw: bytes, planner: LoadPlanner) -> None:
        _safe_load(path, req.storage_index.fqn, raw)
        planner.load_bytes(req, io.BytesIO(raw))

    def _load_tensor(self, path: str, req: ReadItem, t: torch.Tensor, planner: LoadPlanner) -> None:
        key = req.storage_index.fqn
        want = [o + n for o, n in zip(req.storage_offsets, req.lengths)]
        if len(want) != t.dim() or any(w > d for w, d in zip(want, t.shape)):
            raise CorruptCheckpoint(f"{path}: {key!r} is {tuple(t.shape)}; the plan reads offsets "
                                    f"{list(req.storage_offsets)} lengths {list(req.lengths)}", path=path, key=key)
        t = narrow_tensor_by_index(t, req.storage_offsets, req.lengths)
        target = planner.resolve_tensor(req).detach()
        if target.size() != t.size():
            raise CorruptCheckpoint(f"{path}: {key!r} is {tuple(t.size())}, the plan expects "
                                    f"{tuple(target.size())}", path=path, key=key)
        target.copy_(t)
        planner.commit_tensor(req, target)


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
    md: Any = field(default=None, repr=False)
    records: dict[MetadataIndex, Record] = field(default_factory=dict, repr=False)

    @property
    def kind_name(self) -> str:
        return KIND_NAMES.get(self.kind, self.kind)


def describe(path: str, name: str = METADATA) -> DcpInfo:
    """The summary of ``path``'s metadata file ``name`` (validated first); raise CorruptCheckpoint."""
    where = os.path.join(path, name)
    md = read_metadata_file(where)
    kind, records = validate(md, where, path)
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
    info.md, info.records = md, records
    return info


def verify(path: str, name: str = METADATA, io_cfg: IOConfig | None = None) -> DcpInfo:
    """Check every byte (zerostall.dcp) or every record (FileSystemWriter); raise CorruptCheckpoint."""
    info = describe(path, name)
    by_file = _by_file(info.records, info.md.storage_data)
    if info.kind == "zerostall":
        largest = max((v.file_bytes for rs in by_file.values() for _, v in rs), default=4096)
        with shard_io(path, io_cfg, largest, prefault=False) as (eng, bounce):
            for fname, rs in by_file.items():
                v0 = rs[0][1]
                with eng.open_read(os.path.join(path, fname)) as f:
                    read_shard(f, os.path.join(path, fname), v0.file_bytes,
                               ShardHeader(v0.file_id, 0, v0.rank, v0.file_bytes), [r for r, _ in rs],
                               [None] * len(rs), bounce)
        return info
    for fname, rs in by_file.items():
        fpath = os.path.join(path, fname)
        with open(fpath, "rb") as f:
            for r, _ in rs:
                f.seek(r.offset)
                _safe_load(fpath, r.key, f.read(r.nbytes))
    return info
