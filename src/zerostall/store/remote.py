"""Remote tiers: where committed checkpoints are trickled to, chosen by URL (:mod:`.tier`).

A remote tier keeps the local layout (``step-N/<shards>``, ``step-N/manifest.json``) and
commits the object-store way (:class:`RemoteTier`). Called from the replicator thread
(uploads, deletes) and from ``load``/the CLI (listing, downloads). Every OS or botocore error
leaves as a :class:`~zerostall.errors.RemoteError` naming the URL (and step); nothing here
retries (a failed step stays pending for the replicator's next pass).
Implementations: :class:`~.s3.S3Tier`, :class:`~.sharedfs.FileTier`.
"""

from __future__ import annotations

import contextlib
import logging
import os
import tempfile
import threading
from abc import abstractmethod
from typing import Any, Callable

import crc32c as _crc

from ..config import ALIGN_BYTES
from ..errors import CheckpointExistsError, CheckpointNotFound, CorruptCheckpoint, RemoteError, ZerostallError
from ..format.manifest import MANIFEST_NAME, MAX_MANIFEST_BYTES, Manifest
from ..format.validate import parse_step_dir
from .tier import Tier
from ..io import choose_engine
from ..memory.arena import Arena
from .files import file_crc32c
from .remote_replace import set_aside, sweep

log = logging.getLogger("zerostall")
LIST_TIMEOUT_S = 10.0
"""How long a reader waits for a remote listing before going on without it."""


def step_of(rel: str) -> int | None:
    """The step of a key under ``step-<N>/`` (canonical spellings only, as on every tier)."""
    return parse_step_dir(rel.split("/", 1)[0])


class RemoteTier(Tier):
    """One remote location, implementing :class:`~.tier.Tier` the object-store way: data
    objects go to their final names (each verified by its crc32c read back), the manifest
    last (:meth:`commit`); :meth:`delete` removes the manifest first. No lock: the replicator
    of the local root's owner writes it; :meth:`own` only creates the bucket/directory.
    One thread at a time, except :meth:`cancel`. Implementations provide the primitives
    below; names are ``step-N/<name>`` (``rel``)."""

    url: str

    @abstractmethod
    def read_bytes(self, rel: str, limit: int) -> bytes:
        """At most ``limit + 1`` bytes of ``rel`` (so callers can tell "over the limit");
        CheckpointNotFound if it does not exist."""

    @abstractmethod
    def checksum(self, rel: str) -> tuple[int, int]:
        """(size, crc32c) of what the tier stores for ``rel``, recomputed by reading it back."""

    @abstractmethod
    def _open_read(self, rel: str, size: int, engine: Any) -> Any: ...

    @abstractmethod
    def ensure_root(self) -> None: ...

    @abstractmethod
    def _put_file(self, local_path: str, rel: str, crc: int) -> None: ...

    @abstractmethod
    def _put_bytes(self, data: bytes, rel: str) -> None: ...

    def put_bytes(self, data: bytes, rel: str) -> None:
        self._put_bytes(data, rel)

    @abstractmethod
    def _delete(self, rel: str) -> None:
        """Remove one object/file (absent is fine)."""

    @abstractmethod
    def _delete_prefix(self, rel: str) -> None: ...

    @abstractmethod
    def _copy_within(self, src: str, dst: str) -> bool:
        """Copy ``src`` to ``dst`` on the tier; True if ``dst`` is ``src``'s bytes by
        construction (a hard link), so there is nothing to check."""

    def copy_object(self, src: str, dst: str, size: int) -> None:
        """Copy ``src`` (``size`` bytes) to ``dst`` on the tier, checked against the source's
        crc32c; CorruptCheckpoint if the source is not what its step says."""
        got = self.stat(src)
        if got != size:
            raise CorruptCheckpoint(f"{self.where(src)}: {'missing' if got is None else f'{got} bytes'}, its "
                                    f"manifest says {size}", path=self.where(src))
        if self._copy_within(src, dst):
            return
        want = self.stored_crc(src)
        got_size, got_crc = self.checksum(dst)
        if (got_size, got_crc) != (size, want):
            self._delete(dst)
            raise CorruptCheckpoint(f"{self.where(src)}: its copy holds {got_size} bytes with crc32c {got_crc:08x}, "
                                    f"recorded {size} bytes with crc32c {want:08x} (damaged?)", path=self.where(src))

    def stored_crc(self, rel: str) -> int:
        """The crc32c of ``rel``'s bytes (recorded at upload where the tier keeps it, else read)."""
        return self.checksum(rel)[1]

    def download(self, rel: str, local_path: str, size: int) -> None:
        """Fetch ``rel`` (``size`` bytes) into ``local_path`` (replaced) through one aligned
        buffer, written with the engine probed there (direct I/O where it allows)."""
        eng = choose_engine(os.path.dirname(local_path), self.io)
        buf = Arena(min(64 << 20, max(size, ALIGN_BYTES)), mlock=False)
        try:
            with self._open_read(rel, size, None) as r:
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(local_path)
                with eng.open_write(local_path, size) as w:
                    for off in range(0, size, buf.nbytes):
                        mv = buf.mv[:min(buf.nbytes, size - off)]
                        r.read([(off, mv)])
                        w.write([(off, mv)])
                    w.finish()
        except RemoteError:
            raise
        except OSError as exc:
            raise self.error(rel, f"downloading {self.where(rel)} to {local_path} failed: {exc}") from exc
        finally:
            eng.close()
            buf.close()

    def cancel(self) -> None:
        """Abandon in-flight transfers (the close deadline passed); any thread."""

    # -- the Tier protocol: reading ---------------------------------------------------------------
    def read_manifest(self, step: int) -> Manifest:
        return self.read_manifest_raw(step)[1]

    def read_manifest_raw(self, step: int) -> tuple[bytes, Manifest]:
        """``step``'s manifest as stored, and parsed (validated, of ``step``)."""
        rel = f"step-{step}/{MANIFEST_NAME}"
        raw = self.read_bytes(rel, MAX_MANIFEST_BYTES)
        if len(raw) > MAX_MANIFEST_BYTES:
            raise CorruptCheckpoint(f"{self.where(rel)}: manifest is over the {MAX_MANIFEST_BYTES} byte limit",
                                    path=self.where(rel))
        man = Manifest.from_bytes(raw, where=self.where(rel))
        if man.step != step:
            raise CorruptCheckpoint(f"{self.where(rel)}: manifest says step {man.step}", path=self.where(rel))
        return raw, man

    def open_shard_read(self, step: int, name: str, engine: Any = None) -> Any:
        rel = f"step-{step}/{name}"
        size = self.stat(rel)
        if size is None:
            raise CheckpointNotFound(f"{self.where(rel)}: shard is missing")
        return self._open_read(rel, size, engine)

    # -- owning -----------------------------------------------------------------------------------
    def own(self, timeout_s: float | None = None) -> list[str]:
        self.ensure_root()
        return []

    def release(self) -> None:
        pass

    # -- writing ------------------------------------------------------------------------------------
    def begin(self, step: int) -> str:
        """No staging area: a committed step there is first set aside (:mod:`.remote_replace`).
        Returns the step's location."""
        set_aside(self, step)
        return self.where(f"step-{step}")

    def commit(self, step: int, manifest: Manifest, overwrite: bool = False) -> tuple[str, ...]:
        """Check every shard the manifest names has its size, then put the manifest: the commit point."""
        rel = f"step-{step}/{MANIFEST_NAME}"
        if not overwrite and self.stat(rel) is not None:
            raise CheckpointExistsError(f"step {step} already exists in {self.url} (pass overwrite=True)")
        for fe in manifest.files:
            got = self.stat(f"step-{step}/{fe.name}")
            if got != fe.file_bytes:
                raise self.error(f"step-{step}/{fe.name}", f"{self.where(f'step-{step}/{fe.name}')}: "
                                 f"{'missing' if got is None else got} (bytes), the manifest says "
                                 f"{fe.file_bytes}; not committing step {step}")
        self.upload_bytes(manifest.to_bytes(), rel)
        self.hook("commit")
        try:  # after the commit point: what the manifest does not name (a replaced copy) goes
            sweep(self, step, manifest)
        except ZerostallError as exc:
            return (f"step {step} is committed on {self.url}, but removing the objects it replaced failed: {exc}",)
        return ()

    def open_shard_write(self, step: int, name: str, nbytes: int, engine: Any = None) -> Any:
        """Spooled to a local temporary file; at ``finish()`` uploaded as the replicator uploads a
        file (:meth:`upload`: verified by its crc32c), the object appearing whole."""
        return ShardIO(_Spool(self, f"step-{step}/{name}", nbytes))

    def abort(self, step: int) -> None:
        if self.stat(f"step-{step}/{MANIFEST_NAME}") is None:
            self._delete_prefix(f"step-{step}/")

    def delete(self, step: int) -> None:
        self._delete(f"step-{step}/{MANIFEST_NAME}")
        self._delete_prefix(f"step-{step}/")
        self._verdicts.pop(step, None)

    # -- shared logic -------------------------------------------------------------------------
    def upload(self, local_path: str, rel: str, crc: int | None = None) -> None:
        """Copy a local file to ``rel`` and :meth:`verify` it against the local file's crc32c."""
        if crc is None:
            _, crc = file_crc32c(local_path)
        self._put_file(local_path, rel, crc)
        self.verify(rel, os.path.getsize(local_path), crc)

    def upload_bytes(self, data: bytes, rel: str, previous: bytes | None = None) -> None:
        """Store ``data`` at ``rel`` and read it back to check it (manifests). If the check fails,
        ``previous`` (the committed manifest it replaced) is put back, or else the object removed."""
        self._put_bytes(data, rel)
        try:
            self.verify(rel, len(data), _crc.crc32c(data))
        except BaseException:
            try:
                if previous is not None:
                    self._put_bytes(previous, rel)
                else:
                    self._delete(rel)
            except ZerostallError as exc:
                log.warning("zerostall: cannot remove or replace unverified %s: %s", self.where(rel), exc)
            raise

    def verify(self, rel: str, size: int, crc: int) -> None:
        """The tier must store ``size`` bytes with ``crc`` at ``rel``, else RemoteError (object removed)."""
        got_size, got_crc = self.checksum(rel)
        if (got_size, got_crc) != (size, crc):
            try:
                self._delete(rel)
            except ZerostallError as exc:
                log.warning("zerostall: cannot remove %s: %s", self.where(rel), exc)
            raise self.error(rel, f"{self.where(rel)}: the tier stores {got_size} bytes with crc32c {got_crc:08x}, "
                             f"sent {size} bytes with crc32c {crc:08x}; the object was removed and will be "
                             "uploaded again")

    def where(self, rel: str = "") -> str:
        return f"{self.url.rstrip('/')}/{rel}" if rel else self.url

    def error(self, rel: str, msg: str, **kw: Any) -> RemoteError:
        """A :class:`RemoteError` about ``rel``, with its URL and step attached; ``msg`` names it."""
        return RemoteError(msg, url=self.where(rel), step=step_of(rel), **kw)


def list_steps(remote: RemoteTier, timeout_s: float = LIST_TIMEOUT_S) -> tuple[list[int] | None, str]:
    """(the remote's committed steps, "") or (None, why), logged, if the listing fails or
    takes over ``timeout_s`` (a hung mount; its daemon thread is abandoned)."""
    out: dict[str, Any] = {}

    def run() -> None:
        try:
            out["steps"] = remote.steps()
        except BaseException as exc:  # noqa: BLE001 - reported below
            out["error"] = exc

    t = threading.Thread(target=run, name="zerostall-list", daemon=True)
    t.start()
    t.join(timeout_s)
    if "steps" in out:
        return out["steps"], ""
    why = str(out.get("error") or f"listing {remote.url}: no answer within {timeout_s:g} s")
    log.warning("zerostall: cannot list the remote tier, going on without it: %s", why)
    return None, why


class ShardIO:
    """A ShardFile-like wrapper: ``inner``'s ``read``, ``write``, ``finish`` and ``ident`` (what a
    reader read: an object's version, if known); ``close()`` closes ``inner``, then runs
    ``on_close``, once."""

    def __init__(self, inner: Any, on_close: Callable[[], None] | None = None):
        self.inner, self._on_close = inner, on_close
        self.closed = False

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        try:
            if hasattr(self.inner, "close"):
                self.inner.close()
        finally:
            if self._on_close is not None:
                self._on_close()

    def __enter__(self) -> "ShardIO":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class _Spool:
    """A shard written to a local temporary file, in any order, then uploaded at ``finish()``
    the way :meth:`RemoteTier.upload` uploads a local file (verified by its crc32c)."""

    def __init__(self, tier: RemoteTier, rel: str, nbytes: int):
        self.tier, self.rel, self.nbytes = tier, rel, nbytes
        self.file = tempfile.NamedTemporaryFile(prefix="zerostall-upload-")

    def write(self, extents: Any, overlap: Any = None) -> None:
        try:
            for off, mv in extents:
                self.file.seek(off)
                self.file.write(mv)
            self.file.flush()
        except OSError as exc:
            raise self.tier.error(self.rel, f"spooling {self.tier.where(self.rel)} to {self.file.name} failed: "
                                  f"{exc}") from exc
        if overlap is not None:
            overlap()

    def finish(self) -> None:
        if (got := os.fstat(self.file.fileno()).st_size) != self.nbytes:
            raise self.tier.error(self.rel, f"{self.tier.where(self.rel)}: {got} bytes written, {self.nbytes} declared")
        self.tier.upload(self.file.name, self.rel)

    def close(self) -> None:
        self.file.close()
