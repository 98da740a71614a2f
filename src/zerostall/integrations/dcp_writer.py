"""A ``torch.distributed.checkpoint`` storage writer on zerostall's engines and shard codec
(docs/dcp.md: usage, and the ``FileSystemWriter`` semantics it keeps). The reader is
:mod:`.dcp_reader`.

Each rank writes its items into one shard file through :mod:`zerostall.format.shard`; the
coordinator writes DCP's ``.metadata`` last. Commit and overwrite, crash by crash (every
state is a committed checkpoint)::

    1. rank-RRRRR-<save>.shard   written, fdatasync'ed (each rank; <save> is fresh per save,
                                 so a crashed save never blocks the next with O_EXCL)
    2. .metadata.<save>.tmp      written, fdatasync'ed              (coordinator)
    3. rename(tmp, .metadata)    atomic replace: old or new metadata, never neither
                                 (overwrite=False: link(), which refuses an existing one)
    4. fsync(dir)                the new metadata is durable
    5. unlink unreferenced rank-*-*.shard and .metadata.*.tmp   (leftovers of this
                                 checkpoint's earlier or crashed saves; nothing else)

Call order (DCP's): ``reset`` -> ``set_up_storage_writer`` -> ``prepare_local_plan`` (every
rank) -> ``prepare_global_plan`` (coordinator) -> ``write_data`` (every rank; a background
thread in ``async_save``) -> ``finish`` (coordinator; every rank when ``use_collectives=False``).
One Writer serves one save at a time.
"""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import io
import logging
import os
import pickle
import re
import uuid
from dataclasses import dataclass
from typing import Any, Iterator

import torch
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta
from torch.distributed.checkpoint.planner import SavePlan, SavePlanner, WriteItemType
from torch.distributed.checkpoint.storage import StorageWriter, WriteResult
from torch.futures import Future

from ..config import IOConfig
from ..errors import CheckpointExistsError, ConfigError, CorruptCheckpoint, storage_error
from ..format.dtypes import dtype_name
from ..format.layout import ShardHeader, pack_offsets
from ..format.shard import write_shard
from ..memory.arena import Arena
from ..store.local import fsync_dir, write_file_durable
from ..io import choose_engine

log = logging.getLogger("zerostall")

METADATA = ".metadata"  # without collectives each rank writes __R.metadata
DCP_VERSION = "1.0.0"  # the ``Metadata.version`` FileSystemWriter records for this layout
WINDOW_BYTES = 64 << 20
SHARD_RE = re.compile(r"^rank-(\d{5,})-([0-9a-f]{12})\.shard$")  # storage index, save id
_TMP_RE = re.compile(r"^(__\d+)?\.metadata\.[0-9a-f]{12}\.tmp$")


@dataclass(frozen=True)
class _ZSInfo:
    """Where one DCP storage item lives (``Metadata.storage_data``'s values); ``rank`` is the
    storage index, ``file_id`` the id in the shard's header. Pickled into ``.metadata``:
    renaming or moving it breaks existing checkpoints."""

    file: str
    offset: int
    nbytes: int
    crc32c: int
    dtype: str  # "" for BYTE_IO
    shape: tuple[int, ...]
    file_id: str
    rank: int
    file_bytes: int

    @property
    def relative_path(self) -> str:
        # what FileSystemReader asks of every record: say what this is instead of AttributeError
        raise UnsupportedCheckpoint(
            f"{self.file} belongs to a zerostall.dcp checkpoint; FileSystemReader cannot read it: load it "
            "with zerostall.dcp.Reader (same arguments)")


class UnsupportedCheckpoint(CorruptCheckpoint):
    """A valid DCP checkpoint of a kind this reader does not read (the message says which does)."""


class CheckpointAlreadyExists(CheckpointExistsError, RuntimeError):
    """``overwrite=False`` and the directory already holds DCP metadata: a ``RuntimeError`` with
    DCP's own text, as ``FileSystemWriter`` raises, and a :class:`~zerostall.errors.CheckpointExistsError`."""


def check_checkpoint_id(checkpoint_id: Any) -> str:
    """The absolute local path for ``checkpoint_id``; URLs are refused (never a ``scheme:`` dir)."""
    if not isinstance(checkpoint_id, (str, os.PathLike)):
        raise ConfigError(f"DCP checkpoint id must be a path, got {type(checkpoint_id).__name__} {checkpoint_id!r}")
    p = os.fsdecode(checkpoint_id)  # a PathLike may give bytes
    if "://" in p:
        raise ConfigError(
            f"zerostall.dcp writes local (or mounted shared) directories; {p!r} is a URL. Save to a local "
            "directory and replicate it with Checkpointer(remote=...), or use DCP's FsspecWriter for URLs")
    if not p:
        raise ConfigError("DCP checkpoint id is empty")
    return os.path.abspath(p)


class CheckpointId:
    """DCP's ``checkpoint_id`` and ``validate_checkpoint_id`` (a local path, never a URL),
    shared by :class:`Writer` and :class:`~.dcp_reader.Reader`."""

    checkpoint_id: str | os.PathLike[str]
    path: str  # checkpoint_id as an absolute path

    def _set_id(self, checkpoint_id: str | os.PathLike[str]) -> None:
        self.path = check_checkpoint_id(checkpoint_id)
        self.checkpoint_id = checkpoint_id

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike[str]) -> bool:
        try:
            check_checkpoint_id(checkpoint_id)
        except Exception:  # noqa: BLE001 - DCP asks yes/no
            return False
        return True


def _link_no_clobber(src: str, dst: str) -> None:
    """Make ``src`` appear as ``dst`` unless ``dst`` exists (atomically where hard links work)."""
    try:
        os.link(src, dst)
    except OSError as exc:
        if exc.errno not in (errno.EPERM, errno.EOPNOTSUPP, errno.ENOSYS, errno.EXDEV, errno.EMLINK):
            raise
        # no hard links here (some FUSE/network filesystems): check, then rename (a racing
        # writer could slip in between; FileSystemWriter has the same window)
        if os.path.lexists(dst):
            raise FileExistsError(errno.EEXIST, "exists", dst) from None
        os.rename(src, dst)


@contextlib.contextmanager
def shard_io(path: str, io_cfg: IOConfig | None, largest: int, prefault: bool) -> Iterator[tuple[Any, Arena]]:
    """The I/O engine for ``path`` and a bounce buffer for files of up to ``largest`` bytes."""
    bounce = Arena(min(WINDOW_BYTES, largest), mlock=False, prefault=prefault)
    try:
        eng = choose_engine(path, io_cfg or IOConfig())
        try:
            yield eng, bounce
        finally:
            eng.close()
    finally:
        bounce.close()


def metadata_name(rank: int | None, use_collectives: bool) -> str:
    return METADATA if use_collectives or rank is None else f"__{rank}{METADATA}"


class Writer(CheckpointId, StorageWriter):
    """``FileSystemWriter``'s drop-in: ``dcp.save(sd, storage_writer=Writer(path))``. ``overwrite``
    as there (default True); ``io`` picks the engine (default: probed). The other arguments are
    accepted and ignored, except ``sync_files=False``, which is refused."""

    def __init__(self, path: str | os.PathLike[str], *, io: IOConfig | None = None, overwrite: bool = True,
                 sync_files: bool = True, thread_count: int = 1, single_file_per_rank: bool = True,
                 per_thread_copy_ahead: int = 10_000_000, cache_staged_state_dict: bool = False):
        super().__init__()
        if not sync_files:
            raise ConfigError("zerostall.dcp.Writer always makes checkpoints durable; sync_files=False is not "
                              "supported (drop the argument)")
        self._set_id(path)
        self.io = io
        self.overwrite = overwrite
        self.save_id = uuid.uuid4().hex  # fresh per save (reset)
        self.is_coordinator = False
        self.rank: int | None = None
        self.use_collectives = True

    # -- DCP's interface ----------------------------------------------------------------
    def reset(self, checkpoint_id: str | os.PathLike[str] | None = None) -> None:
        if checkpoint_id:
            self._set_id(checkpoint_id)
        self.save_id = uuid.uuid4().hex

    def set_up_storage_writer(self, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        self.is_coordinator = is_coordinator
        self.rank = kwargs.get("rank")
        self.use_collectives = kwargs.get("use_collectives", True)

    def _metadata_path(self) -> str:
        # without collectives every rank writes its own; rank 0's says whether one exists
        return os.path.join(self.path, metadata_name(0, self.use_collectives))

    def prepare_local_plan(self, plan: SavePlan) -> SavePlan:
        try:
            os.makedirs(self.path, exist_ok=True)
        except OSError as exc:
            raise storage_error("creating DCP checkpoint directory", self.path, exc) from exc
        if os.path.lexists(self._metadata_path()):
            if not self.overwrite:
                raise CheckpointAlreadyExists(
                    f"Checkpoint already exists and self.overwrite={self.overwrite}. ({self._metadata_path()} "
                    "exists; pass overwrite=True to replace it, or pick another directory)")
            log.info("zerostall: overwriting the DCP checkpoint in %s", self.path)
        if self.rank is not None and not self.use_collectives:
            plan = dataclasses.replace(plan, storage_data=int(self.rank))
        return plan

    def prepare_global_plan(self, plans: list[SavePlan]) -> list[SavePlan]:
        return [p if p.storage_data is not None else dataclasses.replace(p, storage_data=i)
                for i, p in enumerate(plans)]

    def write_data(self, plan: SavePlan, planner: SavePlanner) -> Future[list[WriteResult]]:
        index = int(plan.storage_data or 0)
        fname = f"rank-{index:05d}-{self.save_id[:12]}.shard"
        payloads, kinds = [], []  # kinds: each item's (dtype name, shape)
        for item in plan.items:
            data = planner.resolve_data(item)
            if item.type == WriteItemType.BYTE_IO:
                raw = data.getvalue() if isinstance(data, io.BytesIO) else bytes(data.read())
                flat = torch.frombuffer(bytearray(raw), dtype=torch.uint8) if raw else torch.empty(0, dtype=torch.uint8)
                dt, shape = "", (len(raw),)
            else:
                t = data.detach().cpu().resolve_conj().resolve_neg().contiguous()
                dt, shape = dtype_name(t.dtype, item.index.fqn), tuple(t.shape)
                flat = t.reshape(-1).view(torch.uint8) if t.numel() else torch.empty(0, dtype=torch.uint8)
            payloads.append(flat)
            kinds.append((dt, shape))
        offsets, file_bytes = pack_offsets([p.numel() for p in payloads])
        crcs = self._write_file(fname, index, offsets, payloads, file_bytes)
        results = [WriteResult(index=item.index, size_in_bytes=p.numel(),
                               storage_data=_ZSInfo(fname, o, p.numel(), crc, dt, shape, self.save_id, index,
                                                    file_bytes))
                   for item, p, o, crc, (dt, shape) in zip(plan.items, payloads, offsets, crcs, kinds)]
        fut: Future[list[WriteResult]] = Future()
        fut.set_result(results)
        return fut

    def _write_file(self, fname: str, index: int, offsets: list[int], payloads: list[torch.Tensor],
                    file_bytes: int) -> list[int]:
        path = os.path.join(self.path, fname)
        with shard_io(self.path, self.io, file_bytes, prefault=True) as (eng, buf):
            try:
                f = eng.open_write(path, file_bytes)
                try:
                    crcs = write_shard(f, ShardHeader(self.save_id, 0, index, file_bytes), payloads, offsets, buf)
                    f.finish()
                finally:
                    f.close()
            except BaseException:
                with contextlib.suppress(OSError):
                    os.unlink(path)  # never referenced by any metadata; don't leave it behind
                raise
        return crcs

    def finish(self, metadata: Metadata, results: list[list[WriteResult]]) -> None:
        metadata.version = DCP_VERSION
        metadata.storage_data = {r.index: r.storage_data for rs in results for r in rs}
        metadata.storage_meta = self.storage_meta()
        name = metadata_name(self.rank, self.use_collectives)
        final = os.path.join(self.path, name)
        tmp = os.path.join(self.path, f"{name}.{self.save_id[:12]}.tmp")
        try:
            write_file_durable(tmp, pickle.dumps(metadata, protocol=pickle.HIGHEST_PROTOCOL))
            if self.overwrite:
                os.replace(tmp, final)
            else:
                try:
                    _link_no_clobber(tmp, final)
                except FileExistsError:
                    raise CheckpointAlreadyExists(
                        f"Checkpoint already exists and self.overwrite=False. ({final} appeared during the "
                        "save; pass overwrite=True to replace it)") from None
                finally:
                    if os.path.lexists(tmp):
                        os.unlink(tmp)
            fsync_dir(self.path)
        except OSError as exc:
            if isinstance(exc, CheckpointExistsError):
                raise
            raise storage_error("committing DCP checkpoint", final, exc) from exc
        keep = {r.storage_data.file for rs in results for r in rs}
        self._remove_leftovers(keep)

    def _remove_leftovers(self, keep: set[str]) -> None:
        """Step 5: this checkpoint's shards no metadata references any more, and temp files."""
        per_rank = not self.use_collectives and self.rank is not None
        try:
            names = os.listdir(self.path)
        except OSError as exc:
            log.warning("zerostall: listing %s to remove old DCP shards failed: %s", self.path, exc)
            return
        if not per_rank and any(re.match(r"^__\d+\.metadata$", n) for n in names):
            log.info("zerostall: %s also holds per-rank DCP metadata; leaving unreferenced shards in place", self.path)
            return
        for n in names:
            m = SHARD_RE.match(n)
            if m is not None:
                if n in keep or (per_rank and int(m.group(1)) != self.rank):
                    continue
            elif not (_TMP_RE.match(n) and (not per_rank or n.startswith(f"__{self.rank}."))
                      and self.save_id[:12] not in n):
                continue
            try:
                os.unlink(os.path.join(self.path, n))
                log.debug("zerostall: removed %s (no longer referenced)", os.path.join(self.path, n))
            except OSError as exc:
                if exc.errno != errno.ENOENT:
                    log.warning("zerostall: removing old DCP file %s failed: %s", n, exc)

    def storage_meta(self) -> StorageMeta | None:
        return StorageMeta(checkpoint_id=self.checkpoint_id, save_id=self.save_id)
