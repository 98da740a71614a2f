"""A ``torch.distributed.checkpoint`` storage plugin on zerostall's engines and layout.

``dcp.save(sd, storage_writer=Writer(path))``, ``dcp.async_save(..., storage_writer=Writer(path))``
and ``dcp.load(sd, storage_reader=Reader(path))``: DCP's planners do the (re)sharding;
zerostall writes each rank's items into one ``rank-R.shard`` (4 KiB header, 4 KiB-aligned
items, O_DIRECT through the chosen engine, fdatasync), records a crc32c per item, and commits
atomically: every rank writes into ``<path>.partial/``; the coordinator's ``finish`` writes
``.metadata``, fsyncs and renames the directory to ``<path>``.

DCP's ``.metadata`` is a pickle. :class:`Reader` loads it with an allow-listing unpickler
(DCP's metadata dataclasses, ``torch.Size``, dtypes, layouts, our storage record) and
rejects anything else, so reading metadata never runs code. DCP's default planner unpickles
non-tensor (``BYTE_IO``) items with ``weights_only=False``; the reader first proves each such
item loads under ``weights_only=True`` and refuses it otherwise.

Call order (DCP's): ``reset`` -> ``set_up_storage_writer`` -> ``prepare_local_plan`` ->
``prepare_global_plan`` (coordinator) -> ``write_data`` (every rank, its own thread in
``async_save``) -> ``finish`` (coordinator).
"""

from __future__ import annotations

import dataclasses
import io
import os
import pickle
import shutil
import uuid
from dataclasses import dataclass
from typing import Any

import crc32c as _crc
import torch
from torch.distributed._shard._utils import narrow_tensor_by_index
from torch.distributed.checkpoint.metadata import Metadata, MetadataIndex, StorageMeta
from torch.distributed.checkpoint.planner import (LoadItemType, LoadPlan, LoadPlanner, SavePlan, SavePlanner,
                                                  WriteItemType)
from torch.distributed.checkpoint.storage import StorageReader, StorageWriter, WriteResult
from torch.futures import Future

from ..config import ALIGN_BYTES, IOConfig
from ..errors import CheckpointExistsError, CheckpointNotFound, CorruptCheckpoint
from ..format.dtypes import dtype_from_name, dtype_name
from ..format.layout import HEADER_BYTES, SHARD_NAME_RE, ShardHeader, align_up, shard_name
from ..io import choose_engine
from ..staging.arena import Arena
from ..store.local import fsync_dir, write_file_durable

METADATA = ".metadata"
WINDOW_BYTES = 64 << 20
_FILE_RE = SHARD_NAME_RE  # .shard, or .zst from before 0.2


@dataclass(frozen=True)
class _ZSInfo:
    """Where one DCP storage item lives: stored in ``Metadata.storage_data``."""

    file: str
    offset: int
    nbytes: int
    crc32c: int
    dtype: str  # "" for BYTE_IO
    shape: tuple[int, ...]
    file_id: str
    rank: int
    file_bytes: int


def _engine(path: str, io_cfg: IOConfig | None) -> Any:
    return choose_engine(path, io_cfg or IOConfig())


class Writer(StorageWriter):
    def __init__(self, path: str | os.PathLike[str], *, io: IOConfig | None = None, overwrite: bool = False):
        super().__init__()
        self.path = os.path.abspath(os.fspath(path))
        self.io = io
        self.overwrite = overwrite
        self.save_id = uuid.uuid4().hex

    @property
    def partial(self) -> str:
        return self.path + ".partial"

    def reset(self, checkpoint_id: str | os.PathLike[str] | None = None) -> None:
        if checkpoint_id is not None:
            self.path = os.path.abspath(os.fspath(checkpoint_id))
        self.save_id = uuid.uuid4().hex

    def set_up_storage_writer(self, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        self.is_coordinator = is_coordinator
        if os.path.exists(self.path) and not self.overwrite:
            raise CheckpointExistsError(f"DCP checkpoint {self.path!r} already exists (pass overwrite=True)")

    def prepare_local_plan(self, plan: SavePlan) -> SavePlan:
        os.makedirs(self.partial, exist_ok=True)
        return plan

    def prepare_global_plan(self, plans: list[SavePlan]) -> list[SavePlan]:
        return [dataclasses.replace(p, storage_data=i) for i, p in enumerate(plans)]

    def write_data(self, plan: SavePlan, planner: SavePlanner) -> Future[list[WriteResult]]:
        rank = int(plan.storage_data or 0)
        fname = shard_name(rank)
        blobs: list[tuple[Any, torch.Tensor, str, tuple[int, ...]]] = []
        for item in plan.items:
            data = planner.resolve_data(item)
            if item.type == WriteItemType.BYTE_IO:
                raw = data.getvalue() if isinstance(data, io.BytesIO) else bytes(data)
                blobs.append((item, torch.frombuffer(bytearray(raw), dtype=torch.uint8) if raw
                              else torch.empty(0, dtype=torch.uint8), "", (len(raw),)))
            else:
                t = data.detach()
                t = t.cpu() if t.device.type != "cpu" else t
                blobs.append((item, t.contiguous().reshape(-1).view(torch.uint8) if t.numel() else
                              torch.empty(0, dtype=torch.uint8), dtype_name(t.dtype, item.index.fqn), tuple(t.shape)))
        offsets, off = [], HEADER_BYTES
        for _, flat, _, _ in blobs:
            offsets.append(off)
            off = align_up(off + flat.numel())
        file_bytes = max(off, HEADER_BYTES)
        header = torch.frombuffer(bytearray(ShardHeader(self.save_id, 0, rank, file_bytes).encode()), dtype=torch.uint8)
        crcs = [0] * len(blobs)
        buf = Arena(min(WINDOW_BYTES, file_bytes), mlock=False)
        eng = _engine(self.partial, self.io)
        f = eng.open_write(os.path.join(self.partial, fname), file_bytes)
        try:
            for w0 in range(0, file_bytes, buf.nbytes):
                w1 = min(w0 + buf.nbytes, file_bytes)
                buf.u8[:w1 - w0].zero_()
                if w0 == 0:
                    buf.u8[:HEADER_BYTES].copy_(header)
                for i, ((_, flat, _, _), o) in enumerate(zip(blobs, offsets)):
                    a, b = max(o, w0), min(o + flat.numel(), w1)
                    if a < b:
                        buf.u8[a - w0:b - w0].copy_(flat[a - o:b - o])
                        crcs[i] = _crc.crc32c(buf.mv[a - w0:b - w0], crcs[i])
                f.write([(w0, buf.mv[:w1 - w0])])
            f.finish()
        finally:
            f.close()
            eng.close()
            buf.close()
        results = [WriteResult(index=item.index, size_in_bytes=flat.numel(),
                               storage_data=_ZSInfo(fname, o, flat.numel(), crc, dt, shape, self.save_id, rank, file_bytes))
                   for (item, flat, dt, shape), o, crc in zip(blobs, offsets, crcs)]
        fut: Future[list[WriteResult]] = Future()
        fut.set_result(results)
        return fut

    def finish(self, metadata: Metadata, results: list[list[WriteResult]]) -> None:
        metadata.storage_data = {r.index: r.storage_data for rs in results for r in rs}
        write_file_durable(os.path.join(self.partial, METADATA), pickle.dumps(metadata))
        fsync_dir(self.partial)
        if os.path.exists(self.path):
            if not self.overwrite:
                raise CheckpointExistsError(f"DCP checkpoint {self.path!r} already exists (pass overwrite=True)")
            shutil.rmtree(self.path)
        os.rename(self.partial, self.path)
        fsync_dir(os.path.dirname(self.path) or ".")

    def storage_meta(self) -> StorageMeta | None:
        return StorageMeta(checkpoint_id=self.path, save_id=self.save_id)

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike[str]) -> bool:
        return isinstance(checkpoint_id, (str, os.PathLike))


_ALLOWED = {
    ("torch.distributed.checkpoint.metadata", n) for n in (
        "BytesStorageMetadata", "ChunkStorageMetadata", "Metadata", "MetadataIndex", "StorageMeta",
        "TensorProperties", "TensorStorageMetadata", "_MEM_FORMAT_ENCODING")
} | {("torch", "Size"), ("torch.serialization", "_get_layout"), ("pathlib", "PosixPath"),
      (__name__, "_ZSInfo"), ("collections", "OrderedDict")}


class _SafeUnpickler(pickle.Unpickler):
    """Resolves only the classes DCP metadata is made of; anything else is corruption."""

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) in _ALLOWED or (module == "torch" and isinstance(getattr(torch, name, None), torch.dtype)):
            return super().find_class(module, name)
        raise CorruptCheckpoint(f"DCP metadata refers to {module}.{name}, which a checkpoint's metadata never "
                                "contains; refusing to unpickle it")


class Reader(StorageReader):
    def __init__(self, path: str | os.PathLike[str], *, io: IOConfig | None = None, verify: bool = True):
        super().__init__()
        self.path = os.path.abspath(os.fspath(path))
        self.io = io
        self.verify = verify
        self.storage_data: dict[MetadataIndex, _ZSInfo] = {}

    def reset(self, checkpoint_id: str | os.PathLike[str] | None = None) -> None:
        if checkpoint_id is not None:
            self.path = os.path.abspath(os.fspath(checkpoint_id))

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        p = os.path.join(self.path, METADATA)
        try:
            with open(p, "rb") as f:
                raw = f.read(256 << 20)
        except FileNotFoundError:
            raise CheckpointNotFound(f"no DCP checkpoint at {self.path!r} ({METADATA} missing)") from None
        try:
            md = _SafeUnpickler(io.BytesIO(raw)).load()
        except CorruptCheckpoint:
            raise
        except Exception as exc:  # noqa: BLE001 - any decoding failure is corruption
            raise CorruptCheckpoint(f"{p}: unreadable DCP metadata ({exc})", path=p) from None
        if not isinstance(md, Metadata) or not isinstance(md.storage_data, dict):
            raise CorruptCheckpoint(f"{p}: not DCP metadata", path=p)
        for info in md.storage_data.values():
            if not isinstance(info, _ZSInfo) or not _FILE_RE.match(info.file) or info.offset % ALIGN_BYTES \
                    or info.offset + info.nbytes > info.file_bytes or info.nbytes < 0:
                raise CorruptCheckpoint(f"{p}: bad storage record {info!r:.200}", path=p)
        return md

    def set_up_storage_reader(self, metadata: Metadata, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        self.storage_data = metadata.storage_data

    def prepare_local_plan(self, plan: LoadPlan) -> LoadPlan:
        return plan

    def prepare_global_plan(self, plans: list[LoadPlan]) -> list[LoadPlan]:
        return plans

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        per_file: dict[str, list[Any]] = {}
        for req in plan.items:
            per_file.setdefault(self.storage_data[req.storage_index].file, []).append(req)
        eng = _engine(self.path, self.io)
        try:
            for fname, reqs in per_file.items():
                self._read_file(eng, fname, reqs, planner)
        finally:
            eng.close()
        fut: Future[None] = Future()
        fut.set_result(None)
        return fut

    def _read_file(self, eng: Any, fname: str, reqs: list[Any], planner: LoadPlanner) -> None:
        path = os.path.join(self.path, fname)
        infos = [self.storage_data[r.storage_index] for r in reqs]
        st = os.lstat(path) if os.path.lexists(path) else None
        if st is None or os.path.islink(path) or st.st_size != infos[0].file_bytes:
            raise CorruptCheckpoint(f"{path}: shard missing, a symlink, or not {infos[0].file_bytes} bytes", path=path)
        cache: dict[tuple[int, int], torch.Tensor] = {}
        with eng.open_read(path) as f:
            hdr = Arena(HEADER_BYTES, mlock=False)
            f.read([(0, hdr.mv)])
            ShardHeader.check(hdr.mv, ShardHeader(infos[0].file_id, 0, infos[0].rank, infos[0].file_bytes), path)
            hdr.close()
            for req, info in sorted(zip(reqs, infos), key=lambda ri: ri[1].offset):
                key = (info.offset, info.nbytes)
                if key not in cache:
                    n = align_up(max(info.nbytes, 1))
                    buf = Arena(n, mlock=False, prefault=False)
                    f.read([(info.offset, buf.mv[:n])])
                    data = buf.u8[:info.nbytes].clone()
                    buf.close()
                    if self.verify and _crc.crc32c(data.numpy().data) != info.crc32c:
                        raise CorruptCheckpoint(f"{path}: item {req.storage_index.fqn!r} failed its crc32c check",
                                                path=path, key=req.storage_index.fqn)
                    cache = {key: data}  # items are read in offset order; keep only the last
                data = cache[key]
                if req.type == LoadItemType.BYTE_IO:
                    raw = data.numpy().tobytes()
                    try:
                        torch.load(io.BytesIO(raw), weights_only=True)
                    except Exception as exc:  # noqa: BLE001
                        raise CorruptCheckpoint(
                            f"{path}: object {req.storage_index.fqn!r} cannot be loaded without running code "
                            f"(weights_only refused it: {str(exc)[:200]})", path=path, key=req.storage_index.fqn) from None
                    planner.load_bytes(req, io.BytesIO(raw))
                    continue
                t = data.view(dtype_from_name(info.dtype, path)).reshape(info.shape)
                t = narrow_tensor_by_index(t, req.storage_offsets, req.lengths)
                target = planner.resolve_tensor(req).detach()
                if target.size() != t.size():
                    raise CorruptCheckpoint(f"{path}: {req.storage_index.fqn!r} is {tuple(t.size())}, the plan "
                                            f"expects {tuple(target.size())}", path=path)
                target.copy_(t)
                planner.commit_tensor(req, target)

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike[str]) -> bool:
        return isinstance(checkpoint_id, (str, os.PathLike))
