"""Ownership of a checkpoint root: one writer at a time, by ``flock`` on ``<root>/.zerostall.lock``.

The writer flocks the lock file for its lifetime (a crash never leaves a root locked). The
file records the holder for :class:`~zerostall.errors.RootLockedError` and is never deleted
(an unlink races with the next ``open``); the root directory is flocked too, so an unlinked
lock file does not let a second writer in. Readers take no lock.

A ``fork()`` shares the locked description, so a forked child closes its copies of every
held lock descriptor (``os.register_at_fork``; ``_FORK_GUARD`` holds forks off while one is
opened), and only the process that acquired a lock unlocks it. Where the filesystem refuses
``flock`` (``ENOLCK``: NFS without a lock manager), the root is used unlocked, with a warning.

Called from the caller's thread (``Checkpointer.__init__``/``close``); not thread-safe.
"""

from __future__ import annotations

import contextlib
import datetime as _dt
import errno
import fcntl
import json
import logging
import os
import socket
import stat
import threading
import time
import weakref

from ..errors import RootLockedError, StorageError, storage_error

log = logging.getLogger("zerostall")

LOCK_NAME = ".zerostall.lock"
_NO_LOCKING = (errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS, errno.EINVAL)


_HELD: "weakref.WeakSet[_Held]" = weakref.WeakSet()
"""Locks whose descriptors this process opened (closed in a forked child)."""

_FORK_GUARD = threading.RLock()
"""Held while a lock descriptor is opened and registered, or unregistered and closed, and by
``os.fork`` (``before=``). Never held across a wait; reentrant (a signal handler may fork)."""


def _after_fork_in_child() -> None:
    """Close the child's copies of the parent's lock descriptors (the parent keeps its flock)."""
    for lock in list(_HELD):
        for fd in lock._forget():
            with contextlib.suppress(OSError):
                os.close(fd)
    _HELD.clear()
    _FORK_GUARD.release()  # taken by this thread before the fork


os.register_at_fork(before=_FORK_GUARD.acquire, after_in_parent=_FORK_GUARD.release,
                    after_in_child=_after_fork_in_child)


def _open_held(lock: "_Held", path: str, flags: int) -> int:
    """Open a descriptor of ``lock`` and register the lock for the at-fork handler in one step."""
    with _FORK_GUARD:
        fd = os.open(path, flags, 0o644)
        lock._pid = os.getpid()
        _HELD.add(lock)
    return fd


def _close_held(lock: "_Held") -> None:
    """Close the descriptors of ``lock``, unlocking their shared description first, but only
    in the process that opened them (see the module docstring)."""
    with _FORK_GUARD:
        _HELD.discard(lock)
        owner = lock._pid == os.getpid()
        for fd in lock._forget():
            if owner:
                with contextlib.suppress(OSError):  # no locking on this filesystem, or never locked
                    fcntl.flock(fd, fcntl.LOCK_UN)
            os.close(fd)


def read_owner(root: str) -> dict[str, object]:
    """What the lock file of ``root`` says about its holder ({} if nothing readable)."""
    return _read_holder(os.path.join(root, LOCK_NAME))


def _read_holder(path: str) -> dict[str, object]:
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW | os.O_NONBLOCK)
    except OSError:
        return {}
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):  # a FIFO or device: never block on it
            return {}
        info = json.loads(os.read(fd, 4096) or b"{}")
        return info if isinstance(info, dict) else {}
    except (OSError, ValueError):
        return {}
    finally:
        os.close(fd)


class _Held:
    """The descriptors of a lock (the at-fork handler and :func:`_close_held` forget them)."""

    def __init__(self, path: str):
        self.path = path
        self._fd: int | None = None
        self._dfd: int | None = None  # RootLock: the root directory, flocked too
        self.enforced = False  # the kernel granted the flock (False: the filesystem has no locking)
        self._pid = 0  # the process that opened the descriptors (only it unlocks them)

    def _forget(self) -> list[int]:
        fds = [d for d in (self._fd, self._dfd) if d is not None]
        self._fd = self._dfd = None
        return fds

    def _take(self, wait: bool) -> bool:
        """Open the lock file and flock it (waiting for a holder if ``wait``); False, closed
        again, if another process holds it. Where the filesystem has no ``flock``: True with
        :attr:`enforced` False. The lock file must be a regular file (O_NONBLOCK: a FIFO planted
        there must not block the open, nor a read later), else StorageError naming it."""
        try:
            self._fd = fd = _open_held(self, self.path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC | os.O_NOFOLLOW
                                       | os.O_NONBLOCK)
        except OSError as exc:
            raise storage_error("creating the lock file", self.path, exc) from exc
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            _close_held(self)
            raise StorageError(f"lock file {self.path!r} is not a regular file; remove it (zerostall recreates "
                               "it) and try again", filename=self.path)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | (0 if wait else fcntl.LOCK_NB))
            self.enforced = True
        except BlockingIOError:
            _close_held(self)
            return False
        except OSError as exc:
            if exc.errno not in _NO_LOCKING:
                _close_held(self)
                raise storage_error("locking", self.path, exc) from exc
            self.enforced = False
        except BaseException:
            _close_held(self)
            raise
        return True

    def _record(self, fd: int) -> None:
        """Write the holder into the locked file (read by :func:`read_owner`, :meth:`FileLock.holder`)."""
        info = {"host": socket.gethostname(), "pid": os.getpid(), "start_unix": round(time.time(), 3)}
        try:
            os.ftruncate(fd, 0)
            os.pwrite(fd, json.dumps(info, sort_keys=True).encode() + b"\n", 0)
        except OSError as exc:  # informational only: the flock is what matters
            log.warning("zerostall: could not record the owner in %s: %s", self.path, exc)


class RootLock(_Held):
    """The exclusive lock on one root. ``acquire`` once, ``release`` once (idempotent)."""

    def __init__(self, root: str):
        super().__init__(os.path.join(root, LOCK_NAME))
        self.root = root

    @property
    def held(self) -> bool:
        return self._fd is not None

    def acquire(self, timeout_s: float = 0.0) -> None:
        """Take the lock, waiting up to ``timeout_s`` (0: fail at once) for another holder;
        :class:`RootLockedError` names the holder, ``StorageError`` the uncreatable lock file."""
        if self._fd is not None:
            return
        deadline = time.monotonic() + max(0.0, timeout_s)
        delay = 0.01
        while not self._take_root():
            if time.monotonic() >= deadline:
                owner = read_owner(self.root)
                since = owner.get("start_unix")
                when = (_dt.datetime.fromtimestamp(since).isoformat(" ", "seconds")
                        if isinstance(since, (int, float)) else "?")
                who = (f"pid {owner.get('pid', '?')} on host {owner.get('host', '?')} (since {when})" if owner
                       else "an unknown process (its lock file is empty: it may be starting up)")
                waited = f" (waited {timeout_s:g} s)" if timeout_s > 0 else ""
                raise RootLockedError(
                    f"checkpoint root {self.root!r} is owned by another writer: {who}{waited}. One "
                    f"Checkpointer writes to a root at a time: close the other one, pick another directory, or "
                    f"pass lock_timeout_s to wait for it (lock file {self.path})", root=self.root, owner=owner)
            time.sleep(delay)
            delay = min(0.2, delay * 2)
        if not self.enforced:
            log.warning("zerostall: %s does not support flock: the root is used without an owner lock; make "
                        "sure only one process writes checkpoints there", self.root)
        self._record(self._fd)

    def _take_root(self) -> bool:
        """One try: the lock file, then the root directory (a writer whose lock file was
        unlinked still holds that)."""
        if not self._take(wait=False):
            return False
        try:
            self._dfd = _open_held(self, self.root, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
            if self.enforced:
                fcntl.flock(self._dfd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            _close_held(self)
            return False
        except OSError:  # no flock on directories here: the lock file alone
            pass
        return True

    def release(self) -> None:
        """Drop the lock. Idempotent."""
        _close_held(self)

    def __del__(self) -> None:  # a half-built Checkpointer must not keep the root locked
        try:
            self.release()
        except Exception:  # noqa: BLE001 - interpreter shutdown (contextlib may be gone by then)
            pass


FETCH_STEP_LOCK = ".zerostall-fetch-step-{step}.lock"
FETCH_STEP_LOCK_RE = r"^\.zerostall-fetch-step-(\d{1,19})\.lock$"


class FileLock(_Held):
    """An exclusive ``flock`` on one file that its last holder removes (``release(unlink=True)``),
    so :meth:`acquire` checks, once locked, that the path still names that file. Caller's
    thread; one acquire, one release."""

    def acquire(self, wait: bool = True) -> bool:
        """Take the lock (waiting for a holder if ``wait``); False if held elsewhere and not
        ``wait``. Where the filesystem has no ``flock``, returns True unenforced."""
        while self._take(wait):
            if not self.enforced:
                return True
            try:
                same = os.stat(self.path, follow_symlinks=False).st_ino == os.fstat(self._fd).st_ino
            except FileNotFoundError:
                same = False
            except BaseException:
                _close_held(self)
                raise
            if same:
                self._record(self._fd)
                return True
            _close_held(self)  # its last holder removed it while we waited: lock the new one
        return False

    def holder(self) -> str:
        """Who holds it, as its file says (for log lines)."""
        info = _read_holder(self.path)
        return f"pid {info.get('pid', '?')} on host {info.get('host', '?')}" if info else "another process"

    def release(self, unlink: bool = True) -> None:
        """Remove the file (while still holding it, so a waiter sees it gone) and unlock.
        ``unlink`` only in the process that acquired it (a forked child never removes it)."""
        if self._fd is None:
            return
        try:
            if unlink and self._pid == os.getpid():
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(self.path)
        finally:
            _close_held(self)


class StepLock(FileLock):
    """``flock`` on ``<root>/.zerostall-fetch-step-N.lock``, held by a process that downloads
    step N into a root it does not own (``load(remote=)``): the owner's start-up cleanup
    (:mod:`.recovery`) skips that step's leftovers while it is held."""

    def __init__(self, root: str, step: int):
        super().__init__(os.path.join(root, FETCH_STEP_LOCK.format(step=step)))
