"""The local tier: a directory of ``step-<N>/`` checkpoints, owned by one writer, committed atomically.

Commit protocol (POSIX), run by the owner's persist thread once every shard is written
(hook names, the crash-test seam, in quotes)::

    1. step-N.partial/rank-*.shard  written and fdatasync'ed       (persist, per shard)
    2. step-N.partial/manifest.json written, fdatasync'ed          ("manifest")
    3. fsync(step-N.partial/)                                      ("fsync_dir")
    4. new step:  rename step-N.partial -> step-N                  ("rename")
       overwrite: renameat2(RENAME_EXCHANGE) step-N.partial <-> step-N ("exchange"), or where
                  the filesystem cannot: step-N -> step-N.old ("rename_old"), step-N.partial
                  -> step-N ("rename")
    5. fsync(root)                                                 ("fsync_root")
       overwrite: the old copy -> .deleting-*, removed             ("rename_deleting", "unlink")
    6. latest.tmp -> latest, fsync root                            ("latest_tmp", "latest")

Every state between two of those syscalls is a committed step or something the owner's
start-up recovery finishes (:mod:`.recovery`). After 4 the checkpoint exists; 6 is a hint for
humans and tools, and a failure there is a post-commit problem, never a failed save.

Deleting a committed step (retention, a bad download) renames it to ``.deleting-step-N-*``
("delete_rename"), fsyncs the root ("delete_fsync"), then removes the files ("unlink"); for
retention after a commit the persist thread removes them later (:class:`~.atomic.DeferredRemovals`).

Only the owner writes (:meth:`LocalTier.own`, :mod:`.owner`); readers take no lock: a step
directory appears only by rename, complete.
"""

from __future__ import annotations

import contextlib
import logging
import os
import stat as stat_mod
import uuid
from typing import Any

from ..config import IOConfig
from ..errors import (CheckpointExistsError, CheckpointNotFound, CorruptCheckpoint, RootNotFound,
                      StepOrderError, storage_error)
from ..format.manifest import MANIFEST_NAME, MAX_MANIFEST_BYTES, Manifest
from ..format.validate import read_small
from .atomic import DeferredRemovals, fsync_dir, publish_dir, rmtree, write_file_durable
from .owner import RootLock
from .recovery import _OLD_RE, _PARTIAL_RE, _TEMP_RE, recover_root
from .retention import ManifestRefs
from .tier import Tier
from ..io.base import Engine, ShardFile, choose_engine
from .files import dir_manifests, manifest_stat, open_shard_checked

log = logging.getLogger("zerostall")


class LocalTier(Tier):
    """A root directory on this node's filesystem; callers may also write a step's files into its
    staging directory (:meth:`partial_dir`) themselves, then commit it (the distributed commit,
    restore's download, peer replicas)."""

    exchange = True  # renameat2(RENAME_EXCHANGE) for overwrites; tests set False (two-phase path)

    def __init__(self, root: str, *, create: bool = False, lock_timeout_s: float = 0.0,
                 io: "IOConfig | None" = None):
        self.root = self.url = os.path.abspath(os.fspath(root))
        self.io = io  # for shards opened without an engine
        self.lock_timeout_s = lock_timeout_s
        self._lock = RootLock(self.root)
        self.deferred = DeferredRemovals(self.root, self.hook)
        """Deleted steps whose files the persist thread removes later (``delete(defer=True)``)."""
        if os.path.exists(self.root) and not os.path.isdir(self.root):
            raise CheckpointNotFound(f"checkpoint path {self.root!r} is a file, not a directory")
        if create:
            try:
                os.makedirs(self.root, exist_ok=True)
            except OSError as exc:
                raise storage_error("creating checkpoint directory", self.root, exc) from exc
            self.check_writable()

    # -- naming ---------------------------------------------------------------------------
    def step_dir(self, step: int) -> str:
        return os.path.join(self.root, f"step-{step}")

    def partial_dir(self, step: int) -> str:
        return os.path.join(self.root, f"step-{step}.partial")

    def _names(self) -> list[str]:
        try:
            return os.listdir(self.root)
        except FileNotFoundError:
            return []

    def check_root(self) -> None:
        if not os.path.isdir(self.root):
            raise RootNotFound(f"checkpoint directory {self.root!r} does not exist (check the path; a "
                               "Checkpointer creates it at its first save)", root=self.root)

    # -- reading (any thread, any process, no lock) ----------------------------------------
    def where(self, rel: str = "") -> str:
        return os.path.join(self.root, rel)

    def _manifests(self) -> dict[int, Any]:
        try:
            return dir_manifests(self.root)
        except FileNotFoundError:
            return {}

    def manifest_refs(self, step: int) -> Manifest | ManifestRefs:
        """``step``'s ``ref_files`` for retention, cached while the manifest keeps its identity."""
        ident = self.manifest_ident(step)
        hit = self._verdict(step, ident)
        if hit is not None and hit[2] is not None:
            return ManifestRefs(step, hit[2])
        man = self.read_manifest(step)
        self._verdicts[step] = (ident, True, tuple(man.ref_files))
        return man

    def manifest_ident(self, step: int) -> Any:
        return manifest_stat(self.step_dir(step))

    def stat(self, rel: str) -> int | None:
        try:
            st = os.stat(os.path.join(self.root, rel), follow_symlinks=False)
        except OSError:
            return None
        return st.st_size if stat_mod.S_ISREG(st.st_mode) else None

    def names_in(self, step: int) -> list[str]:
        try:
            return sorted(os.listdir(self.step_dir(step)))
        except OSError:
            return []

    def put_bytes(self, data: bytes, rel: str) -> None:
        path = os.path.join(self.root, rel)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        write_file_durable(path, data)
        fsync_dir(os.path.dirname(path))

    def partial_steps(self) -> list[int]:
        return sorted(int(m.group(1)) for n in self._names() if (m := _PARTIAL_RE.match(n)))

    def leftovers(self) -> list[str]:
        """Names a crash or an interrupted operation left in the root (what :meth:`own` cleans)."""
        return sorted(n for n in self._names() if _PARTIAL_RE.match(n) or _OLD_RE.match(n)
                      or n.startswith(".deleting-") or _TEMP_RE.match(n))

    def check_writable(self) -> None:
        """Create and remove a file in the root; raise StorageError naming the root if we cannot."""
        probe = os.path.join(self.root, f".zerostall-write-test-{os.getpid()}")
        try:
            os.close(os.open(probe, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o600))
            with contextlib.suppress(FileNotFoundError):  # the owner's start-up cleanup got there first
                os.unlink(probe)
        except OSError as exc:
            raise storage_error("writing to checkpoint directory", self.root, exc,
                                "pick a writable directory or fix its permissions/attributes") from exc

    def read_manifest(self, step: int) -> Manifest:
        return self._read_manifest_at(self.step_dir(step), step)

    def _read_manifest_at(self, d: str, step: int, name: str = MANIFEST_NAME) -> Manifest:
        if os.path.islink(d):
            raise CorruptCheckpoint(f"{d} is a symlink; a checkpoint's files must live "
                                    "inside the checkpoint directory", path=d)
        path = os.path.join(d, name)
        try:
            raw = read_small(path, MAX_MANIFEST_BYTES)  # regular files only: no FIFO, no symlink
        except FileNotFoundError:
            raise CheckpointNotFound(f"no committed checkpoint for step {step} in {self.root!r} "
                                     f"(steps: {self.listed_steps() or 'none'})") from None
        except OSError as exc:
            raise CorruptCheckpoint(f"{path}: cannot read manifest ({os.strerror(exc.errno or 0)})",
                                    path=path) from exc
        man = Manifest.from_bytes(raw, where=path)
        if man.step != step:
            raise CorruptCheckpoint(f"{path}: manifest says step {man.step}, directory says {step}", path=path)
        return man

    def open_shard_read(self, step: int, name: str, engine: "Engine | None" = None) -> "ShardFile":
        """The engine's reader of ``name`` (:func:`.files.open_shard_checked`). Any thread."""
        return open_shard_checked(engine or choose_engine(self.root, self.io), os.path.join(self.step_dir(step), name))

    # -- owning (caller's thread) ----------------------------------------------------------
    @property
    def owned(self) -> bool:
        return self._lock.held

    def own(self, timeout_s: float | None = None) -> list[str]:
        """Take the root (waiting up to ``timeout_s``, default ``lock_timeout_s``; else
        ``RootLockedError``), then finish or remove what a crash left (:mod:`.recovery`)."""
        self._lock.acquire(self.lock_timeout_s if timeout_s is None else timeout_s)
        try:
            return recover_root(self)
        except BaseException:
            self._lock.release()
            raise

    def release(self) -> None:
        self._lock.release()

    # -- save side (owner; persist thread, except check_new_step on the caller's) -----------
    def check_new_step(self, step: int, overwrite: bool, allow_lower: bool = True) -> None:
        """Refuse ``step`` before anything is written: it exists (without ``overwrite``), or it
        is lower than the newest committed step (without ``allow_lower``; see retention)."""
        if not overwrite and os.path.lexists(self.step_dir(step)):
            raise self._exists(step)
        if not allow_lower:
            newest = self.latest()
            if newest is not None and step < newest:
                raise StepOrderError(
                    f"step {step} is lower than step {newest}, the newest committed checkpoint in "
                    f"{self.root!r} (left by an earlier run?). Retention and load() rank steps by number, "
                    f"so the runs would mix: resume from step {newest}, use another directory, delete the "
                    f"higher steps, or pass allow_lower_steps=True", step=step, newest=newest)

    def _exists(self, step: int) -> CheckpointExistsError:
        return CheckpointExistsError(f"step {step} already exists in {self.root!r} (pass overwrite=True or pick "
                                     "another step)")

    def begin(self, step: int) -> str:
        """Create ``step-N.partial/`` (replacing a stale one); return its path."""
        d = self.partial_dir(step)
        try:
            rmtree(d)
            os.mkdir(d, 0o755)
        except OSError as exc:
            raise storage_error("creating", d, exc) from exc
        return d

    def open_shard_write(self, step: int, name: str, nbytes: int, engine: "Engine | None" = None) -> "ShardFile":
        eng = engine or choose_engine(self.root, self.io)
        return eng.open_write(os.path.join(self.partial_dir(step), name), nbytes)

    def commit(self, step: int, manifest: Manifest, overwrite: bool = False, *,
               latest: bool = True) -> tuple[str, ...]:
        """Steps 2-6 of the protocol (:meth:`Tier.commit`). ``latest=False`` leaves step 6 to
        the caller (:meth:`write_latest`), e.g. after it reported the step durable."""
        part, final = self.partial_dir(step), self.step_dir(step)
        try:
            write_file_durable(os.path.join(part, MANIFEST_NAME), manifest.to_bytes())
            self.hook("manifest")
            fsync_dir(part)
            self.hook("fsync_dir")
            publish_dir(part, final, overwrite=overwrite, hook=self.hook, exchange=self.exchange)
        except FileExistsError:  # publish_dir's: the step exists and overwrite is False
            raise self._exists(step) from None
        except OSError as exc:
            raise storage_error(f"committing step {step} in", self.root, exc) from exc
        # we wrote this manifest: neither listing nor retention needs to parse it again
        self._verdicts[step] = (self.manifest_ident(step), True, tuple(manifest.ref_files))
        return self.write_latest(step) if latest else ()

    def write_latest(self, step: int) -> tuple[str, ...]:
        """Step 6: the ``latest`` hint; returns the problem, if any, instead of raising."""
        tmp = os.path.join(self.root, "latest.tmp")
        try:
            newest = self.latest()
            write_file_durable(tmp, f"step-{step if newest is None else max(newest, step)}\n".encode())
            self.hook("latest_tmp")
            os.rename(tmp, os.path.join(self.root, "latest"))
            fsync_dir(self.root)
            self.hook("latest")
        except Exception as exc:  # noqa: BLE001 - after the commit point nothing undoes the commit
            msg = f"step {step} is committed, but updating {os.path.join(self.root, 'latest')} failed: {exc}"
            log.warning("zerostall: %s", msg)
            with contextlib.suppress(OSError):
                os.unlink(tmp)
            return (msg,)
        return ()

    def abort(self, step: int) -> None:
        try:
            rmtree(self.partial_dir(step))
        except OSError as exc:
            log.warning("zerostall: could not remove %s: %s", self.partial_dir(step), exc)

    def delete(self, step: int, *, defer: bool = False) -> None:
        """Remove a committed step: rename it out of the listing, fsync the root, then delete
        its files (``defer``: :attr:`deferred` does, on the persist thread)."""
        d = self.step_dir(step)
        gone = os.path.join(self.root, f".deleting-step-{step}-{uuid.uuid4().hex[:8]}")
        try:
            try:
                os.rename(d, gone)
            except FileNotFoundError:
                return
            self.hook("delete_rename")
            fsync_dir(self.root)
            self.hook("delete_fsync")
            if defer:
                self.deferred.add(gone)
            else:
                rmtree(gone, self.hook)
        except OSError as exc:
            raise storage_error(f"deleting step {step} from", self.root, exc) from exc
        log.info("zerostall: removed step %d from %s", step, self.root)


