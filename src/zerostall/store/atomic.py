"""Atomic directory operations on POSIX filesystems: publish (with crash-safe overwrite),
discard, and the start-up recovery that completes them; plus durable small files.

Used by the local tier and the DCP plugin (anything that commits a directory by renaming
it). Every function is synchronous; callers are the owner of the parent directory (one
process, see :mod:`.owner`) on its persist thread or its caller's thread at start-up.
:class:`DeferredRemovals` lets the persist thread remove a tree it already took out of the
listing at a time of its choosing (while its next writes are in flight).
``hook`` arguments are the test seam: called with a boundary name after each
rename/unlink/fsync, so a test can crash the process at every boundary.
"""

from __future__ import annotations

import ctypes
import errno
import fcntl
import logging
import os
import platform
import stat
import uuid
from contextlib import contextmanager, suppress
from typing import Callable, Iterator

from .._fast import libc as _libc
from ..io.probe import fs_of

Hook = Callable[[str], None]
log = logging.getLogger("zerostall")

_AT_FDCWD = -100
RENAME_EXCHANGE = 2
# renameat2(2) syscall numbers, for a libc without the wrapper (glibc < 2.28, some musl)
_SYS_RENAMEAT2 = {"x86_64": 316, "aarch64": 276, "ppc64le": 357, "s390x": 347, "riscv64": 276}

_renameat2 = getattr(_libc, "renameat2", None)

EXCHANGE_UNSUPPORTED = (errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP, errno.ENOTSUP)


def fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


@contextmanager
def unlinked_on_error(tmp: str) -> Iterator[str]:
    """Yield ``tmp``, a temporary file the block writes and renames into place; if the block
    raises, ``tmp`` is removed (quietly) and the error goes on. Any thread."""
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
    """Atomically swap the names ``a`` and ``b`` (``renameat2(RENAME_EXCHANGE)``).

    Returns False, having changed nothing, where the kernel, libc or filesystem cannot
    (EINVAL/ENOSYS/EOPNOTSUPP: e.g. NFS, older kernels); raises OSError for other failures.
    """
    ba, bb = os.fsencode(a), os.fsencode(b)
    if _renameat2 is not None:
        rc = _renameat2(_AT_FDCWD, ba, _AT_FDCWD, bb, RENAME_EXCHANGE)
    else:
        nr = _SYS_RENAMEAT2.get(platform.machine())
        if nr is None:
            return False
        rc = _libc.syscall(nr, _AT_FDCWD, ba, _AT_FDCWD, bb, RENAME_EXCHANGE)
    if rc == 0:
        return True
    err = ctypes.get_errno()
    if err in EXCHANGE_UNSUPPORTED:
        return False
    raise OSError(err, os.strerror(err), a, None, b)


def rmtree(path: str, hook: Hook | None = None) -> None:
    """Remove ``path`` (a directory tree or a file) without following symlinks.

    Unlike ``shutil.rmtree`` it calls ``hook("unlink")`` after each entry it removes, so
    tests can crash between any two unlinks. A missing path is not an error.
    """
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return
    if not stat.S_ISDIR(st.st_mode):
        os.unlink(path)
        if hook is not None:
            hook("unlink")
        return
    for entry in os.scandir(path):
        if entry.is_dir(follow_symlinks=False):
            rmtree(entry.path, hook)
        else:
            try:
                os.unlink(entry.path)
            except FileNotFoundError:
                continue
            if hook is not None:
                hook("unlink")
    try:
        os.rmdir(path)
    except FileNotFoundError:
        return
    if hook is not None:
        hook("unlink")


def _noop(_: str) -> None:
    pass


def free_bytes(path: str) -> int:
    """Bytes an unprivileged writer may still allocate on ``path``'s filesystem (the seam the
    tests fake a nearly full disk with)."""
    st = os.statvfs(path)
    return st.f_bavail * st.f_frsize


def unshared(path: str) -> bool:
    """Whether the file at ``path`` has no other name (a hard link: a user's ``cp -al`` backup,
    zerostall's own links) and no open file description of any process refers to it now: a
    write lease (``F_SETLEASE``) is granted only then, and released at once; the kernel grants
    it whatever the link count. False where leases are refused (another owner, a filesystem or
    platform without them) or on any error."""
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
"""Filesystems one kernel serves alone: a write lease there sees every process that has a file
open. On one that other nodes mount (NFS, CephFS, Lustre, GPFS, FUSE clients) it sees only this
node's, and a reader elsewhere keeps an unlinked file's bytes but not ones written over."""


class DeferredRemovals:
    """Trees already out of their directory's listing (renamed to ``.deleting-*``, the rename
    fsynced), whose files are removed later by the thread that owns the directory.

    Unlinking a large file frees its extents (and, on a filesystem mounted with ``discard``,
    trims them): tens of milliseconds per GiB of the owner thread's time, and a new file's
    first writes then allocate and convert extents again. So the persist thread first takes
    a doomed shard to write the next save over (:meth:`take`), and runs the rest of the
    removals while the next save's writes are in flight (or when it has nothing queued)
    instead of between one commit and the next write. A crash before :meth:`run` leaves
    ``.deleting-*`` entries, which the owner's start-up recovery removes.
    Owner thread only (not thread-safe); ``hook`` is the crash-test seam, read at each call.
    """

    MARGIN_BYTES = 64 << 20
    """Free space asked beyond a new file's size before deferring removals further."""

    def __init__(self, root: str, hook: Hook):
        self.root, self._hook = root, hook
        self.paths: list[str] = []
        self.spare = True
        """Whether :meth:`run` may keep one file for :meth:`take` (``CheckpointConfig.spare_shard``)."""
        self._local: bool | None = None

    def _local_fs(self) -> bool:
        """Whether the root is on a :data:`LOCAL_FS` (read once, when first needed)."""
        if self._local is None:
            self._local = fs_of(self.root)[0] in LOCAL_FS
        return self._local

    def __bool__(self) -> bool:
        return bool(self.paths)

    def add(self, path: str) -> None:
        self.paths.append(path)

    def run(self, keep: str | None = None) -> None:
        """Remove every pending tree now, except, with ``keep`` (and :attr:`spare`), the first
        regular file of that name: a spare the next save may write over; its tree stays
        pending. A failure is logged, never raised: the tree is out of the listing already
        and the next owner's recovery removes what is left."""
        kept = None
        for path in list(self.paths):
            try:
                if (kept is None and keep is not None and self.spare and self._local_fs()
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
        """Move the file ``name`` of a pending tree to ``dest`` (on the same filesystem) for
        the persist thread to write over: its blocks are reused instead of freed and allocated
        again. Only a regular file that no process has open (:func:`unshared`: a reader that
        opened the doomed step before it left the listing keeps reading its bytes), on a
        filesystem no other node mounts (:data:`LOCAL_FS`). Returns whether it moved one. A
        crash after the move leaves it in ``dest``'s partial directory, which recovery removes."""
        if not self.paths or not self._local_fs():
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
        """Before preallocating ``nbytes``: remove the pending trees now unless the filesystem
        has room for ``nbytes`` (and a margin) beside them, so deferring never costs an ENOSPC."""
        if self.paths:
            try:
                short = free_bytes(self.root) < nbytes + self.MARGIN_BYTES
            except OSError:
                short = True
            if short:
                self.run()


def discard(path: str, hook: Hook | None = None) -> None:
    """Take ``path`` out of its directory's listing (rename to ``.deleting-<name>-<id>``), then
    remove it. A crash leaves only a ``.deleting-*`` entry, which the owner removes at start-up."""
    hook = hook or _noop
    parent, name = os.path.split(path)
    gone = os.path.join(parent, f".deleting-{name}-{uuid.uuid4().hex[:8]}")
    try:
        os.rename(path, gone)
    except FileNotFoundError:
        return
    hook("rename_deleting")
    rmtree(gone, hook)


def publish_dir(staged: str, final: str, *, overwrite: bool = False, hook: Hook | None = None,
                exchange: bool = True) -> str:
    """Make the complete, fsynced directory ``staged`` visible as ``final``, crash-safely.

    - ``final`` absent: ``rename``, then fsync the parent.
    - ``final`` present (``overwrite`` required, else FileExistsError): swap the two with
      ``renameat2(RENAME_EXCHANGE)`` (readers see the old or the new copy, never neither),
      fsync the parent, then discard the old copy (now at ``staged``). Where the filesystem
      cannot exchange (or ``exchange=False``): rename ``final`` to ``final.old``, ``staged``
      to ``final``, fsync the parent, discard ``final.old``; a crash between the two renames
      leaves ``final`` absent and ``final.old`` intact, which :func:`recover_dir` restores.

    The parent is always fsynced before an old copy is deleted. Returns the strategy used
    (``"rename"``, ``"exchange"`` or ``"two-phase"``). Called by the owner only.
    """
    hook = hook or _noop
    parent = os.path.dirname(final)
    if not os.path.lexists(final):
        os.rename(staged, final)
        hook("rename")
        fsync_dir(parent)
        hook("fsync_root")
        return "rename"
    if not overwrite:
        raise FileExistsError(errno.EEXIST, "exists", final)
    if exchange and rename_exchange(staged, final):
        hook("exchange")
        fsync_dir(parent)
        hook("fsync_root")
        discard(staged, hook)
        return "exchange"
    old = final + ".old"
    if os.path.lexists(old):  # an earlier crash's copy; final is valid, so this one is stale
        discard(old, hook)
    os.rename(final, old)
    hook("rename_old")
    os.rename(staged, final)
    hook("rename")
    fsync_dir(parent)
    hook("fsync_root")
    discard(old, hook)
    return "two-phase"


def recover_dir(final: str, is_valid: Callable[[str], bool], hook: Hook | None = None) -> list[str]:
    """Finish what an interrupted :func:`publish_dir`/:func:`discard` left around ``final``.

    ``final.old`` is restored when ``final`` is missing or invalid and the old copy is valid,
    and removed otherwise; ``.deleting-<name>*`` entries are removed. ``staged`` directories
    are the caller's to remove. Returns one line per action. Called by the owner only.
    """
    hook = hook or _noop
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
