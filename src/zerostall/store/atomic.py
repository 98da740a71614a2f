"""Atomic directory operations on POSIX filesystems: publish (with crash-safe overwrite),
discard, their recovery, and durable small files. Callers own the parent directory;
``hook`` arguments are the crash-test seam (a boundary name after each rename/unlink/fsync).
"""

from __future__ import annotations

import ctypes
import errno
import fcntl
import logging
import os
import stat
import uuid
from contextlib import contextmanager, suppress
from functools import cached_property
from typing import Callable, Iterator

from .._fast import libc as _libc
from ..io.probe import fs_of

Hook = Callable[[str], None]
log = logging.getLogger("zerostall")

_AT_FDCWD = -100
RENAME_EXCHANGE = 2
_renameat2 = getattr(_libc, "renameat2", None)  # glibc >= 2.28

EXCHANGE_UNSUPPORTED = (errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP, errno.ENOTSUP)


def _noop(_: str) -> None:
    pass


def fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


@contextmanager
def unlinked_on_error(tmp: str) -> Iterator[str]:
    """Yield ``tmp``, a file the block writes and renames into place; removed if the block raises."""
    try:
        yield tmp
    except BaseException:
        with suppress(OSError):
            os.unlink(tmp)
        raise


def write_file_durable(path: str, data: bytes) -> None:
    """Create ``path`` with ``data`` and fdatasync it (small files: manifests, pointers)."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC | os.O_NOFOLLOW, 0o644)
    try:
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view):]
        os.fdatasync(fd)
    finally:
        os.close(fd)


def rename_exchange(a: str, b: str) -> bool:
    """Atomically swap the names ``a`` and ``b`` (``renameat2(RENAME_EXCHANGE)``). False,
    having changed nothing, where the libc or filesystem cannot (e.g. NFS)."""
    if _renameat2 is None:
        return False
    if _renameat2(_AT_FDCWD, os.fsencode(a), _AT_FDCWD, os.fsencode(b), RENAME_EXCHANGE) == 0:
        return True
    err = ctypes.get_errno()
    if err in EXCHANGE_UNSUPPORTED:
        return False
    raise OSError(err, os.strerror(err), a, None, b)


def rmtree(path: str, hook: Hook = _noop) -> None:
    """Remove ``path`` (tree or file; missing is fine) without following symlinks, calling
    ``hook("unlink")`` after each entry."""
    try:
        if stat.S_ISDIR(os.lstat(path).st_mode):
            for entry in os.scandir(path):
                rmtree(entry.path, hook)
            os.rmdir(path)
        else:
            os.unlink(path)
    except FileNotFoundError:
        return
    hook("unlink")


def free_bytes(path: str) -> int:
    """Bytes an unprivileged writer may still allocate on ``path``'s filesystem (a test seam)."""
    st = os.statvfs(path)
    return st.f_bavail * st.f_frsize


def unshared(path: str) -> bool:
    """Whether the file at ``path`` has one name and no process has it open now (a write lease,
    granted only then, is taken and released at once); False where leases are refused."""
    setlease = getattr(fcntl, "F_SETLEASE", None)  # Linux only
    if setlease is None:
        return False
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    except OSError:
        return False
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or st.st_nlink != 1:
            return False
        fcntl.fcntl(fd, setlease, fcntl.F_WRLCK)
        fcntl.fcntl(fd, setlease, fcntl.F_UNLCK)
        return True
    except OSError:
        return False
    finally:
        os.close(fd)


LOCAL_FS = frozenset({"ext2", "ext3", "ext4", "xfs", "btrfs", "f2fs", "zfs", "bcachefs", "jfs", "nilfs2",
                      "tmpfs", "overlay"})
"""Filesystems one kernel serves alone, where a write lease sees every process that has a file
open (on NFS, CephFS, Lustre, ... it sees only this node's)."""


class DeferredRemovals:
    """Trees already out of their directory's listing (renamed to ``.deleting-*``, the rename
    fsynced), whose files the owner's persist thread removes later: it takes a doomed shard to
    write the next save over (:meth:`take`, reusing its extents), and runs the other removals
    while the next save's writes are in flight. Owner thread only."""

    MARGIN_BYTES = 64 << 20
    """Free space asked beyond a new file's size before deferring removals further."""

    def __init__(self, root: str, hook: Hook):
        self.root, self._hook = root, hook
        self.paths: list[str] = []
        self.spare = True
        """Whether :meth:`run` may keep one file for :meth:`take` (``CheckpointConfig.spare_shard``)."""

    @cached_property
    def _local(self) -> bool:
        return fs_of(self.root)[0] in LOCAL_FS

    def __bool__(self) -> bool:
        return bool(self.paths)

    def add(self, path: str) -> None:
        self.paths.append(path)

    def run(self, keep: str | None = None) -> None:
        """Remove every pending tree now, except, with ``keep`` (and :attr:`spare`), the first
        regular file of that name, for :meth:`take`. A failure is logged, never raised."""
        kept = None
        for path in list(self.paths):
            try:
                if (kept is None and keep is not None and self.spare and self._local
                        and os.path.isfile(os.path.join(path, keep))):
                    kept = path
                    for entry in os.scandir(path):
                        if entry.name != keep:
                            rmtree(entry.path, self._hook)
                    continue
                rmtree(path, self._hook)
            except OSError as exc:
                log.warning("zerostall: could not remove %s (removed at the next start-up): %s", path, exc)
            self.paths.remove(path)

    def take(self, name: str, dest: str) -> bool:
        """Move the file ``name`` of a pending tree to ``dest`` to write over, if no process has it
        open (:func:`unshared`) on a :data:`LOCAL_FS`; returns whether it moved one."""
        if not self.paths or not self._local:
            return False
        for tree in self.paths:
            src = os.path.join(tree, name)
            if unshared(src):
                try:
                    os.rename(src, dest)
                except OSError:
                    continue
                self._hook("recycle")
                return True
        return False

    def run_if_short(self, nbytes: int) -> None:
        """Before preallocating ``nbytes``: remove the pending trees now unless there is room for
        ``nbytes`` and a margin beside them, so deferring never costs an ENOSPC."""
        if self.paths:
            try:
                short = free_bytes(self.root) < nbytes + self.MARGIN_BYTES
            except OSError:
                short = True
            if short:
                self.run()


def discard(path: str, hook: Hook = _noop) -> None:
    """Take ``path`` out of its directory's listing (rename to ``.deleting-<name>-<id>``), then
    remove it. A crash leaves only a ``.deleting-*`` entry, which the owner removes at start-up."""
    parent, name = os.path.split(path)
    gone = os.path.join(parent, f".deleting-{name}-{uuid.uuid4().hex[:8]}")
    try:
        os.rename(path, gone)
    except FileNotFoundError:
        return
    hook("rename_deleting")
    rmtree(gone, hook)


def publish_dir(staged: str, final: str, *, overwrite: bool = False, hook: Hook = _noop,
                exchange: bool = True) -> str:
    """Make the complete, fsynced directory ``staged`` visible as ``final``, crash-safely (steps
    4-5 of :mod:`.local`'s protocol); an existing ``final`` needs ``overwrite`` (else
    FileExistsError). Returns ``"rename"``, ``"exchange"`` or ``"two-phase"``. Owner only."""
    doomed = None  # the old copy, deleted once the parent is fsynced
    if not os.path.lexists(final):
        how = "rename"
        os.rename(staged, final)
        hook("rename")
    elif not overwrite:
        raise FileExistsError(errno.EEXIST, "exists", final)
    elif exchange and rename_exchange(staged, final):
        how, doomed = "exchange", staged
        hook("exchange")
    else:
        how, doomed = "two-phase", final + ".old"
        if os.path.lexists(doomed):  # an earlier crash's copy; final is valid, so this one is stale
            discard(doomed, hook)
        os.rename(final, doomed)
        hook("rename_old")
        os.rename(staged, final)
        hook("rename")
    fsync_dir(os.path.dirname(final))
    hook("fsync_root")
    if doomed is not None:
        discard(doomed, hook)
    return how


def recover_dir(final: str, is_valid: Callable[[str], bool], hook: Hook = _noop) -> list[str]:
    """Finish an interrupted :func:`publish_dir`: ``final.old`` is restored when ``final`` is
    invalid and the old copy valid, else removed. Returns one line per action. Owner only."""
    parent, name = os.path.split(final)
    done: list[str] = []
    old = final + ".old"
    if os.path.lexists(old):
        if is_valid(final):
            discard(old, hook)
            done.append(f"removed {old} (the previous copy of an overwrite; {name} is committed)")
        elif is_valid(old):
            if os.path.lexists(final):
                discard(final, hook)
            os.rename(old, final)
            hook("restore_old")
            fsync_dir(parent)
            hook("fsync_root")
            done.append(f"restored {final} from {old} (a crash interrupted its overwrite)")
        else:
            discard(old, hook)
            done.append(f"removed {old} (no valid checkpoint inside)")
    return done
