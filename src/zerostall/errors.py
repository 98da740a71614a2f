"""The exceptions zerostall raises, one tree under :class:`ZerostallError` (each class says
when it is raised and what it carries). OS errors are translated at the boundary with
``raise ... from exc``; every message names the file, key or value at fault and what to do.
"""

from __future__ import annotations

from types import MappingProxyType
from typing import Mapping

__all__ = ["CheckpointExistsError", "CheckpointNotFound", "ConfigError", "CorruptCheckpoint", "DistributedError",
           "RemoteError", "RootNotFound", "RootLockedError", "SaveFailed", "StateMismatchError", "StepOrderError",
           "StorageError", "UnsupportedStateError", "ZerostallError"]


class ZerostallError(Exception):
    """Base class of every error zerostall raises on purpose. Keyword arguments become attributes;
    each subclass declares its own, with their defaults."""

    def __init__(self, *args: object, **attrs: object):
        super().__init__(*args)
        for name, value in attrs.items():
            setattr(self, name, value)


class ConfigError(ZerostallError, ValueError):
    """A configuration value or argument is invalid."""


class UnsupportedStateError(ZerostallError, TypeError):
    """A state-dict leaf cannot be stored without pickle, or a tensor cannot be staged."""


class CheckpointExistsError(ZerostallError, FileExistsError):
    """The step is already committed and ``overwrite`` was not set."""


class StepOrderError(ZerostallError, ValueError):
    """``save(step)`` with a step lower than the newest committed step in the root (retention
    and ``load()`` rank by step). ``step`` is the refused step, ``newest`` the root's newest."""

    step: int | None = None
    newest: int | None = None


class RootLockedError(ZerostallError):
    """Another writer holds the checkpoint root's lock (``<root>/.zerostall.lock``). ``root`` is
    the directory, ``owner`` what the lock file records (host, pid, start time; may be empty)."""

    root: str = ""
    owner: Mapping[str, object] = MappingProxyType({})


class CheckpointNotFound(ZerostallError, FileNotFoundError):
    """No committed checkpoint (or not the requested step) exists at the path."""


class RootNotFound(CheckpointNotFound):
    """The checkpoint root (a directory, a bucket) does not exist, as opposed to an existing
    root without checkpoints; ``root`` names it. The CLI reports it as bad usage (exit 2)."""

    root: str = ""


class CorruptCheckpoint(ZerostallError):
    """A manifest or shard failed validation or its crc32c check. ``path`` names the file and
    ``key`` the tensor when known. ``part_loaded``: the load had begun writing the caller's
    state dict when it failed, so the state dict is part this step's, part as it was."""

    path: str | None = None
    key: str | None = None
    part_loaded: bool = False


class StorageError(ZerostallError, OSError):
    """An I/O operation failed; ``errno`` and ``filename`` (keywords, OSError's own attributes)
    are those of the OS error."""

    def __str__(self) -> str:  # OSError's __str__ would print the (errno, strerror) form
        return str(self.args[0]) if self.args else ""


class RemoteError(StorageError):
    """A remote tier failed (unreachable, refused, timed out, or stored other bytes than sent).
    ``url`` is the object or root at fault, ``step`` the step when known; the cause is chained."""

    def __init__(self, message: str, *, url: str = "", step: int | None = None, errno: int | None = None):
        super().__init__(message, errno=errno, filename=url or None)
        self.url = url
        self.step = step


class SaveFailed(ZerostallError):
    """A background save failed; the cause is chained as ``__cause__``; ``step`` when known."""

    step: int | None = None


class DistributedError(ZerostallError):
    """Ranks could not coordinate: a rank did not join or report in time, or the c10d store
    failed. ``missing_ranks`` lists the ranks that did not answer, when known; torch's
    exception (``DistStoreError``, a timeout) is chained as ``__cause__``."""

    missing_ranks: tuple[int, ...] = ()


def storage_error(action: str, path: str, exc: OSError, hint: str = "") -> StorageError:
    """Translate an ``OSError`` into a :class:`StorageError` with a message people can act on."""
    import errno as _errno
    import os

    what = os.strerror(exc.errno) if exc.errno else str(exc)
    if not hint:
        hint = {
            _errno.ENOSPC: "free space on that filesystem or lower retention (keep_last)",
            _errno.EDQUOT: "the disk quota is exhausted; free space or raise the quota",
            _errno.EACCES: "check the directory's permissions",
            _errno.EPERM: "check the directory's permissions",
            _errno.EROFS: "the filesystem is read-only; pick a writable checkpoint directory",
            _errno.EIO: "the device reported an I/O error; check the disk and kernel log (dmesg)",
        }.get(exc.errno or 0, "")
    msg = f"{action} {path!r} failed: {what}"
    if hint:
        msg += f" ({hint})"
    return StorageError(msg, errno=exc.errno, filename=path)


class StateMismatchError(ZerostallError, ValueError):
    """The caller's state dict does not match the checkpoint (shapes, dtypes, keys under ``strict``)."""
