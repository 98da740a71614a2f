"""The engine interface every write/read path implements, and the engine registry.

Call order for a save (all from the persist thread; engines are not thread-safe unless
they say so)::

    w = engine.open_write(path, file_bytes)   # O_DIRECT create + fallocate
    w.write([(offset, memoryview), ...], overlap=fn)  # 0..n times, blocks until written;
                                              # fn() runs once the requests are in flight
    w.finish()                                # fdatasync; an error here is final
    w.close()                                 # always (also after an error)

and for a restore (from the caller's thread)::

    r = engine.open_read(path)
    r.read([(offset, memoryview), ...])       # fills the buffers, blocks
    r.close()

Every offset, length and buffer address is a multiple of ``ALIGN_BYTES``. An ``fdatasync``
error fails the checkpoint and is never retried (the kernel may have dropped the dirty pages;
a retry could report success for data that never reached the disk).
"""

from __future__ import annotations

import errno
import os
from abc import ABC, abstractmethod
from typing import Callable, Sequence

from .._util import load_target
from ..config import ALIGN_BYTES, IOConfig
from ..errors import ConfigError, StorageError, storage_error
from . import _sys

from .probe import ProbeResult, probe

Extent = tuple[int, memoryview]  # (file offset, buffer), both aligned


def split_extents(extents: Sequence[Extent], chunk_bytes: int) -> list[Extent]:
    """Cut extents into requests of at most ``chunk_bytes``."""
    out: list[Extent] = []
    for off, mv in extents:
        n = len(mv)
        if off % ALIGN_BYTES or n % ALIGN_BYTES:
            raise ValueError(f"unaligned extent at offset {off} length {n}")
        for pos in range(0, n, chunk_bytes):
            out.append((off + pos, mv[pos:pos + chunk_bytes]))
    return out


class ShardFile(ABC):
    """An open shard file. Created by an :class:`Engine`; used by one thread at a time. An
    engine's file implements :meth:`_run`, which :meth:`write` and :meth:`read` call."""

    def __init__(self, engine: "Engine", path: str, fd: int, writable: bool):
        self.engine = engine
        self.path = path
        self.fd = fd
        self._closed = False

    def write(self, extents: Sequence[Extent], overlap: Callable[[], None] | None = None) -> None:
        """Write every extent; return when all are in the file (not yet durable). ``overlap`` is
        called once while the requests are in flight; its exception is raised after they end."""
        self._run(split_extents(extents, self.engine.cfg.chunk_bytes), True, overlap)

    def read(self, extents: Sequence[Extent]) -> None:
        """Fill every extent's buffer from the file; short files raise StorageError."""
        self._run(split_extents(extents, self.engine.cfg.chunk_bytes), False, None)

    @abstractmethod
    def _run(self, reqs: list[Extent], write: bool, overlap: Callable[[], None] | None) -> None:
        """Move every request (``chunk_bytes`` at most) as :meth:`write` or :meth:`read` says."""

    def finish(self) -> None:
        """``fdatasync`` the file. Raises :class:`StorageError`; never retried."""
        try:
            self.engine._fdatasync(self.fd)
        except OSError as exc:
            raise storage_error("fdatasync of", self.path, exc,
                                "the data may not be on disk; this checkpoint is abandoned") from exc

    def close(self) -> None:
        if not self._closed:
            self._closed = True
            os.close(self.fd)

    def __enter__(self) -> "ShardFile":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class Engine(ABC):
    """A way to move aligned bytes between memory and files. One instance per Checkpointer."""

    name: str = "?"
    direct: bool = True  # bypasses the page cache (O_DIRECT)
    file_type: type[ShardFile]

    def __init__(self, cfg: IOConfig):
        self.cfg = cfg

    def _open(self, path: str, flags: int, action: str = "opening") -> int:
        """``os.open`` with O_DIRECT if :attr:`direct`, never a symlink; StorageError naming ``path``."""
        try:
            return os.open(path, flags | os.O_CLOEXEC | os.O_NOFOLLOW | (os.O_DIRECT if self.direct else 0), 0o644)
        except OSError as exc:
            raise storage_error(action, path, exc) from exc

    def open_write(self, path: str, file_bytes: int) -> ShardFile:
        """Create ``path`` (must not exist) and preallocate ``file_bytes``."""
        fd = self._open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, "creating")
        self._reserve(fd, path, file_bytes)
        return self._wrap(path, fd, True)

    def open_rewrite(self, path: str, file_bytes: int) -> ShardFile:
        """Open the existing file ``path`` (a doomed step's shard, :meth:`.DeferredRemovals.take`)
        to write ``file_bytes`` over it, reusing its blocks; the caller writes every byte."""
        fd = self._open(path, os.O_WRONLY)
        try:
            if os.fstat(fd).st_size > file_bytes:
                os.ftruncate(fd, file_bytes)
        except OSError as exc:
            os.close(fd)
            raise storage_error(f"truncating to {file_bytes} bytes", path, exc) from exc
        self._reserve(fd, path, file_bytes)
        return self._wrap(path, fd, True)

    @staticmethod
    def _reserve(fd: int, path: str, file_bytes: int) -> None:
        """Preallocate ``file_bytes`` where the filesystem can; else close ``fd`` and raise."""
        try:
            _sys.fallocate(fd, 0, file_bytes, path)
        except OSError as exc:
            if exc.errno not in (errno.EOPNOTSUPP, errno.ENOSYS, errno.EINVAL):
                os.close(fd)
                raise storage_error(f"reserving {file_bytes} bytes for", path, exc) from exc

    def open_update(self, path: str) -> ShardFile:
        """A second writer of ``path`` (created by :meth:`open_write`) for another thread."""
        return self._wrap(path, self._open(path, os.O_WRONLY), True)

    def open_read(self, path: str) -> ShardFile:
        try:
            fd = self._open(path, os.O_RDONLY)
        except StorageError as exc:
            if exc.errno != errno.EINVAL or not self.direct:
                raise
            # the filesystem refuses O_DIRECT for reads: the buffered engine (a registry target, above this module)
            return get_engine("buffered", self.cfg).open_read(path)
        return self._wrap(path, fd, False)

    def _wrap(self, path: str, fd: int, writable: bool) -> ShardFile:
        """The engine's :attr:`file_type` over ``fd`` (closed if that fails)."""
        try:
            return self.file_type(self, path, fd, writable)
        except BaseException:
            os.close(fd)
            raise

    def _fdatasync(self, fd: int) -> None:
        """The seam fault-injection tests replace."""
        os.fdatasync(fd)

    def pin_buffer(self, address: int, nbytes: int, *, fresh: bool = False) -> None:
        """A hint from the thread that writes every file from this region (the persist thread,
        between files): an engine may register it once. ``fresh``: another mapping than the
        one last given, even at the same address."""

    def close(self) -> None:
        """Release rings, pools. Idempotent."""


def transfer(path: str, fd: int, off: int, mv: memoryview, write: bool, flags: int = 0) -> None:
    """Move one extent with ``pwritev``/``preadv`` (the GIL released), resuming short transfers."""
    done = 0
    while done < len(mv):
        try:
            got = (os.pwritev if write else os.preadv)(fd, [mv[done:]], off + done, flags)
        except OSError as exc:
            got = -(exc.errno or errno.EIO)
        err = io_error(path, "write" if write else "read", off + done, len(mv) - done, got)
        if err is not None:
            raise err
        done += got


def io_error(path: str, action: str, offset: int, want: int, got: int) -> StorageError | None:
    """The error of a request for ``want`` bytes that moved ``got`` (``-errno``: it failed), or None."""
    if got < 0:
        exc = OSError(-got, os.strerror(-got))
        return storage_error(f"{action} of {want} bytes at offset {offset} of", path, exc)
    if got == 0 and want:
        return StorageError(f"{action} at offset {offset} of {path!r} transferred 0 of {want} bytes "
                            "(file shorter than expected?)", errno=errno.EIO, filename=path)
    return None


# -- registry -----------------------------------------------------------------------------

_REGISTRY: dict[str, tuple[str | Callable[[IOConfig], Engine], str]] = {
    "threads": ("zerostall.io.threads:ThreadsEngine", ""),
    "uring": ("zerostall.io.uring:UringEngine", "pip install 'zerostall[uring]' (the liburing package)"),
    "buffered": ("zerostall.io.buffered:BufferedEngine", ""),
}
"""name -> (a factory or its lazy ``"module:attr"`` path, the install hint if it fails to import)."""


def register_engine(name: str, factory: Callable[[IOConfig], Engine] | str, hint: str = "") -> None:
    """Register an engine by name: a factory, or a lazy ``"module:attr"`` path."""
    _REGISTRY[name] = (factory, hint)


def engine_names() -> list[str]:
    return sorted(_REGISTRY)


def get_engine(name: str, cfg: IOConfig) -> Engine:
    """Instantiate the engine called ``name`` (not ``auto``; see :func:`choose_engine`)."""
    if name not in _REGISTRY:
        raise ConfigError(f"unknown I/O engine {name!r}; choose one of: auto, {', '.join(engine_names())}")
    target, hint = _REGISTRY[name]
    if callable(target):
        return target(cfg)
    try:
        cls = load_target(target)
    except ImportError as exc:
        raise ConfigError(f"I/O engine {name!r} is not available ({exc}); {hint or 'check the install'}") from exc
    return cls(cfg)


def engine_name_for(path: str, cfg: IOConfig) -> tuple[str, ProbeResult | None]:
    """The engine ``cfg`` asks for on ``path`` (``auto``: the probe's verdict, with its result)."""
    if cfg.engine != "auto":
        return cfg.engine, None
    res = probe(path)
    return res.engine, res


def choose_engine(path: str, cfg: IOConfig | None = None) -> Engine:
    """The engine for files under the directory ``path`` (``auto``: probed once). Any thread."""
    cfg = cfg or IOConfig()
    return get_engine(engine_name_for(path, cfg)[0], cfg)
