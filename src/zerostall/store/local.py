"""The local tier: a directory of ``step-<N>/`` checkpoints, committed atomically.

Commit protocol (POSIX), run by the persist thread once every shard is written::

    1. step-N.partial/rank-*.zst   written and fdatasync'ed        (persist, per shard)
    2. step-N.partial/manifest.json written, fdatasync'ed          ("manifest")
    3. fsync(step-N.partial/)                                      ("fsync_dir")
    4. rename step-N.partial -> step-N                             ("rename")
    5. fsync(root)                                                 ("fsync_root")
    6. latest.tmp -> latest (rename, fsync root)                   ("latest")

A directory without a valid ``manifest.json`` is not a checkpoint. A crash anywhere before 4
leaves only a ``.partial`` directory, ignored by readers and removed by the next
``Checkpointer``; after 4 the checkpoint exists. ``latest`` is a hint for humans and tools;
readers trust the directory listing. ``_hook`` is a test seam called after each named step.
"""

from __future__ import annotations

import errno
import logging
import os
import re
import shutil
from typing import Callable

from ..errors import CheckpointExistsError, CheckpointNotFound, CorruptCheckpoint, storage_error
from ..format.manifest import MANIFEST_NAME, MAX_MANIFEST_BYTES, Manifest

log = logging.getLogger("zerostall")
_STEP_RE = re.compile(r"^step-(\d{1,19})$")
_PARTIAL_RE = re.compile(r"^step-(\d{1,19})\.partial$")


def fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


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


class LocalTier:
    def __init__(self, root: str, *, create: bool = False):
        self.root = os.path.abspath(os.fspath(root))
        self._hook: Callable[[str], None] | None = None
        if os.path.exists(self.root) and not os.path.isdir(self.root):
            raise CheckpointNotFound(f"checkpoint path {self.root!r} is a file, not a directory")
        if create:
            try:
                os.makedirs(self.root, exist_ok=True)
            except OSError as exc:
                raise storage_error("creating checkpoint directory", self.root, exc) from exc
            if not os.access(self.root, os.W_OK | os.X_OK):
                raise storage_error("writing to", self.root, OSError(errno.EACCES, "not writable"))

    # -- naming ---------------------------------------------------------------------------
    def step_dir(self, step: int) -> str:
        return os.path.join(self.root, f"step-{step}")

    def partial_dir(self, step: int) -> str:
        return os.path.join(self.root, f"step-{step}.partial")

    # -- listing (any thread) ---------------------------------------------------------------
    def steps(self) -> list[int]:
        """Committed steps (a directory with a manifest), ascending."""
        try:
            names = os.listdir(self.root)
        except FileNotFoundError:
            return []
        out = []
        for n in names:
            m = _STEP_RE.match(n)
            if m and os.path.isfile(os.path.join(self.root, n, MANIFEST_NAME)) \
                    and not os.path.islink(os.path.join(self.root, n)):
                out.append(int(m.group(1)))
        return sorted(out)

    def partial_steps(self) -> list[int]:
        try:
            names = os.listdir(self.root)
        except FileNotFoundError:
            return []
        return sorted(int(m.group(1)) for n in names if (m := _PARTIAL_RE.match(n)))

    def check_writable(self) -> None:
        """Create and remove a file in the root; raise StorageError naming the root if we cannot."""
        probe = os.path.join(self.root, f".zerostall-write-test-{os.getpid()}")
        try:
            fd = os.open(probe, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o600)
            os.close(fd)
            os.unlink(probe)
        except OSError as exc:
            raise storage_error("writing to checkpoint directory", self.root, exc,
                                "pick a writable directory or fix its permissions/attributes") from exc

    def read_manifest(self, step: int) -> Manifest:
        if os.path.islink(self.step_dir(step)):
            raise CorruptCheckpoint(f"{self.step_dir(step)} is a symlink; a checkpoint's files must live "
                                    "inside the checkpoint directory", path=self.step_dir(step))
        path = os.path.join(self.step_dir(step), MANIFEST_NAME)
        try:
            fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
        except FileNotFoundError:
            raise CheckpointNotFound(f"no committed checkpoint for step {step} in {self.root!r} "
                                     f"(steps: {self.steps() or 'none'})") from None
        except OSError as exc:
            raise CorruptCheckpoint(f"{path}: cannot open manifest ({os.strerror(exc.errno or 0)})",
                                    path=path) from exc
        try:
            size = os.fstat(fd).st_size
            if size > MAX_MANIFEST_BYTES:
                raise CorruptCheckpoint(f"{path}: manifest is {size} bytes, over the "
                                        f"{MAX_MANIFEST_BYTES} limit", path=path)
            with os.fdopen(os.dup(fd), "rb") as f:
                raw = f.read(MAX_MANIFEST_BYTES + 1)
        finally:
            os.close(fd)
        man = Manifest.from_bytes(raw, where=path)
        if man.step != step:
            raise CorruptCheckpoint(f"{path}: manifest says step {man.step}, directory says {step}", path=path)
        return man

    def latest(self) -> int | None:
        steps = self.steps()
        return steps[-1] if steps else None

    # -- save side (persist thread, except begin() which the caller's thread may run) ------
    def check_new_step(self, step: int, overwrite: bool) -> None:
        if not overwrite and os.path.exists(self.step_dir(step)):
            raise CheckpointExistsError(
                f"step {step} already exists in {self.root!r} (pass overwrite=True or pick another step)")

    def clean_stale_partials(self, keep: set[int] = frozenset()) -> None:  # type: ignore[assignment]
        for s in self.partial_steps():
            if s not in keep:
                log.info("zerostall: removing stale partial checkpoint %s", self.partial_dir(s))
                shutil.rmtree(self.partial_dir(s), ignore_errors=True)

    def begin(self, step: int) -> str:
        """Create ``step-N.partial/`` (replacing a stale one); return its path."""
        d = self.partial_dir(step)
        if os.path.lexists(d):
            shutil.rmtree(d, ignore_errors=True)
        try:
            os.mkdir(d, 0o755)
        except OSError as exc:
            raise storage_error("creating", d, exc) from exc
        return d

    def _step(self, name: str) -> None:
        if self._hook is not None:
            self._hook(name)

    def commit(self, step: int, manifest: Manifest, overwrite: bool = False) -> str:
        """Steps 2-6 of the protocol; shards must already be durable."""
        part, final = self.partial_dir(step), self.step_dir(step)
        try:
            write_file_durable(os.path.join(part, MANIFEST_NAME), manifest.to_bytes())
            self._step("manifest")
            fsync_dir(part)
            self._step("fsync_dir")
            if os.path.exists(final):
                if not overwrite:
                    raise CheckpointExistsError(
                        f"step {step} already exists in {self.root!r} (pass overwrite=True or pick another step)")
                trash = final + ".old"
                shutil.rmtree(trash, ignore_errors=True)
                os.rename(final, trash)
                os.rename(part, final)
                shutil.rmtree(trash, ignore_errors=True)
            else:
                os.rename(part, final)
            self._step("rename")
            fsync_dir(self.root)
            self._step("fsync_root")
            tmp = os.path.join(self.root, "latest.tmp")
            write_file_durable(tmp, f"step-{max(self.steps(), default=step)}\n".encode())
            os.rename(tmp, os.path.join(self.root, "latest"))
            fsync_dir(self.root)
            self._step("latest")
        except OSError as exc:
            if isinstance(exc, CheckpointExistsError):
                raise
            raise storage_error(f"committing step {step} in", self.root, exc) from exc
        return final

    def abort(self, step: int) -> None:
        shutil.rmtree(self.partial_dir(step), ignore_errors=True)

    def delete(self, step: int) -> None:
        """Remove a committed step: rename it out of the listing first, then delete."""
        d = self.step_dir(step)
        gone = os.path.join(self.root, f".deleting-step-{step}")
        try:
            os.rename(d, gone)
        except FileNotFoundError:
            return
        fsync_dir(self.root)
        shutil.rmtree(gone, ignore_errors=True)
        log.info("zerostall: retention removed step %d from %s", step, self.root)

    def apply_retention(self, keep_last: int | None, protect: set[int] = frozenset()) -> list[int]:  # type: ignore[assignment]
        """Delete all but the newest ``keep_last`` committed steps (never the newest, never one
        that a kept step references)."""
        if keep_last is None:
            return []
        from .retention import spare_referenced
        steps = self.steps()
        doomed = [s for s in steps[:-keep_last] if s not in protect and s != steps[-1]]
        doomed = spare_referenced(steps, doomed, self.read_manifest)
        for s in doomed:
            self.delete(s)
        return doomed
