"""The one-call :func:`save` and :func:`load` of the public face (``zerostall.save``/``zerostall.load``,
bound there on first use). Caller's thread; ``load`` with ``agree`` runs the collective
agreement of every rank through the c10d store.
"""

from __future__ import annotations

import os
from dataclasses import replace
from typing import Any

from .checkpointer import Checkpointer
from .config import CheckpointConfig, IOConfig
from .distributed.node import discover
from .distributed.store import Store
from .errors import ConfigError, ZerostallError
from .restore import load as _load
from .restore import LoadReport, LoadRequest
from .restore.pipeline import collective_base, collective_load
from .stateful import load_into
from .store import open_root
from .telemetry.record import SaveRecord

__all__ = ["load", "save"]


def save(path: str | os.PathLike[str], state_dict: Any, step: int, *,
         config: CheckpointConfig | None = None, **overrides: Any) -> SaveRecord:
    """Save ``state_dict`` as ``step`` under ``path`` and wait until it is durable. Streams
    through a ring of at most 256 MiB of the process's staging pool (kept for the next call)."""
    with Checkpointer(path, config, oneshot=True, **overrides) as ckpt:
        return ckpt.save(step, state_dict).result()


def load(path: str | os.PathLike[str], state_dict: Any = None, step: int | None = None,
         map_location: Any = None, *, verify: bool = True, fallback: bool = True,
         io: IOConfig | None = None, rank: int | None = None, world_size: int | None = None,
         remote: str | None = None, keys: list[str] | None = None, strict: bool = False,
         report: LoadReport | None = None, agree: bool | None = None, download: bool = True) -> Any:
    """Load the newest checkpoint under ``path`` that verifies (or exactly ``step``).

    With ``state_dict``, tensors are loaded in place and the same object is returned (only
    once the whole step verified: a step that fails leaves it untouched); otherwise a new
    state dict is returned (tensors on ``map_location``: a device, a dict or a callable, as
    ``torch.load`` accepts). ``keys=["model_args"]`` reads only those (dotted) keys' bytes.
    Keys of ``state_dict`` the checkpoint lacks are logged (``strict=True``: raised as
    :class:`~zerostall.errors.StateMismatchError`); pass a :class:`LoadReport` as ``report`` to
    get the step loaded and the missing/unexpected keys. ``rank``/``world_size`` (default:
    from torch.distributed or the environment) pick this rank's state from a checkpoint
    saved per rank.

    ``remote`` (``s3://bucket/prefix``, ``file:///shared/path``): also consider the steps that
    remote tier holds; a newer (or the only) one is downloaded into ``path`` and loaded from
    there. A remote that is down is skipped with a warning when ``path`` has a checkpoint.
    ``download=False``: a step only the remote holds is streamed from it straight into the
    restore pipeline (this rank's files, the byte ranges the load needs; every byte checked
    as from a local copy) and nothing is written under ``path``.

    ``agree``: in a process group, every rank calls ``load`` and all restore the newest step
    that every rank can load, agreed through the c10d store (``report.why`` says which and
    why); if none, every rank raises the same :class:`~zerostall.errors.CheckpointNotFound`
    naming the ranks and files at fault. Default (None): agree when ``rank``/``world_size``
    come from the process group and the checkpoint was saved per rank by a group of this size.
    """
    info = discover()
    if agree is None:  # auto: a per-rank checkpoint of this group, loaded by every rank of it
        agree = rank is None and world_size is None and info.store is not None and info.world_size > 1 \
            and _saved_per_rank_by(os.fspath(path), info.world_size)
    rank = info.rank if rank is None else rank
    world_size = info.world_size if world_size is None else world_size
    request = LoadRequest(step=step, map_location=map_location, verify=verify, fallback=fallback, io=io,
                          remote=remote, keys=keys, strict=strict, download=download)
    if agree:
        if info.store is None or info.world_size < 2:
            raise ConfigError("load(agree=True) needs an initialised process group of more than one rank")
        store = Store(info.store)
        try:
            return load_into(state_dict, lambda sd: collective_load(
                store, collective_base("zerostall/loads"), rank, world_size, os.fspath(path), sd, request,
                report=report))
        finally:
            store.close()
    return load_into(state_dict, lambda sd: _load(os.fspath(path), sd, replace(request, rank=rank,
                                                                               world_size=world_size), report=report))


def _saved_per_rank_by(path: str, world_size: int) -> bool:
    """Whether the newest readable step under ``path`` was saved per rank by ``world_size`` ranks."""
    tier = open_root(path)
    for s in reversed(tier.listed_steps() if os.path.isdir(path) else []):
        try:
            man = tier.read_manifest(s)
        except ZerostallError:
            continue
        return man.world_size == world_size and man.rank_trees is not None
    return False
