"""The Tier protocol: one interface for every place checkpoints live, and the tier registry.

A tier holds checkpoints as ``step-N`` units, each committed by its manifest (POSIX:
:mod:`.local`; object stores: :mod:`.remote`); restore, verify, ls, retention and replication
are functions over tiers. :class:`Tier` says who calls each method, from which thread
(``[owner]``: only the process holding the root). Listing trusts only a manifest that validates.

Tiers register under a URL scheme with a lazy import path and an install hint
(:func:`register_tier`, :func:`open_tier`).
"""

from __future__ import annotations

import logging
from abc import ABC, abstractmethod
from functools import cached_property
from typing import TYPE_CHECKING, Any, Callable
from urllib.parse import urlparse

from .._util import load_target
from ..errors import CheckpointNotFound, ConfigError, CorruptCheckpoint

if TYPE_CHECKING:
    from ..format.manifest import Manifest
    from ..io.base import Engine, ShardFile

log = logging.getLogger("zerostall")


class Tier(ABC):
    """The protocol every tier implements, grouped by who calls it."""

    url: str
    _hook: Callable[[str], None] | None = None
    """The crash-test seam, called with each boundary's name (:mod:`.local`, :mod:`.remote_replace`);
    set on a class as a ``staticmethod`` to reach a Checkpointer's start-up in a forked child."""

    def hook(self, name: str) -> None:
        if self._hook is not None:
            self._hook(name)

    # -- reading: any thread, any process; no lock; a reader never sees a torn step -----------
    @abstractmethod
    def _manifests(self) -> dict[int, Any]:
        """{step: identity of its manifest} for every ``step-N`` holding one, valid or not (one
        listing; the identity changes when the manifest is replaced)."""

    @abstractmethod
    def where(self, rel: str = "") -> str:
        """The path or URL of ``rel`` (``step-N/<name>``) on this tier, for messages."""

    @abstractmethod
    def read_manifest(self, step: int) -> "Manifest":
        """The validated manifest of ``step``; CheckpointNotFound or CorruptCheckpoint."""

    @abstractmethod
    def open_shard_read(self, step: int, name: str, engine: "Engine | None" = None) -> "ShardFile":
        """A ShardFile-like reader of ``name`` of committed ``step``: ``read(extents)``, ``close()``."""

    def check_root(self) -> None:
        """Raise :class:`~zerostall.errors.RootNotFound` naming the root if it does not exist
        (``ls``/``verify`` tell a typo from an empty root)."""

    def manifest_ident(self, step: int) -> Any:
        """Changes when ``step`` is replaced (None: absent), so a reader tells a step replaced
        under it from a damaged one (:mod:`zerostall.restore.pipeline`)."""
        return self._manifests().get(step)

    def listed_steps(self) -> list[int]:
        """Steps holding a manifest, valid or not (``ls``, ``verify`` report the damaged ones)."""
        return sorted(self._manifests())

    def steps(self) -> list[int]:
        """Committed steps whose manifest validates, ascending. Cheap enough to call per save:
        each manifest is parsed once per identity (:attr:`_verdicts`)."""
        return sorted(s for s, ident in self._manifests().items() if self._valid(s, ident))

    def latest(self) -> int | None:
        """The newest committed step, validating manifests newest first only until one is good."""
        idents = self._manifests()
        return next((s for s in sorted(idents, reverse=True) if self._valid(s, idents[s])), None)

    @cached_property
    def _verdicts(self) -> dict[int, tuple[Any, bool, tuple[Any, ...] | None]]:
        """Per step: (its manifest's identity, whether it validates, its ``ref_files`` if known).
        A manifest is parsed once per identity (local: device, inode, mode, size, mtime, ctime;
        remote: etag, size, mtime), so listing a root per save costs a stat per step, and
        retention reads the references of the manifest just written without parsing it. Any
        thread (one dict operation at a time)."""
        return {}

    def _verdict(self, step: int, ident: Any) -> tuple[Any, bool, tuple[Any, ...] | None] | None:
        hit = self._verdicts.get(step)
        return hit if ident is not None and hit is not None and hit[0] == ident else None

    def _valid(self, step: int, ident: Any) -> bool:
        """Whether ``step``'s manifest (identity ``ident``; None: absent) validates: the cached
        verdict, else read it (a missing or corrupt manifest is invalid, logged; any other error,
        e.g. an unreachable remote, is raised)."""
        if ident is None:
            return False
        if (hit := self._verdict(step, ident)) is not None:
            return hit[1]
        refs = None
        try:
            refs = tuple(self.read_manifest(step).ref_files)
        except (CorruptCheckpoint, CheckpointNotFound) as exc:
            log.warning("zerostall: %s is not a loadable checkpoint (%s); load and retention ignore it",
                        self.where(f"step-{step}"), exc)
        self._verdicts[step] = (ident, refs is not None, refs)
        return refs is not None

    def partial_steps(self) -> list[int]:
        """Steps with an uncommitted staging area (``ls``)."""
        return []

    @abstractmethod
    def stat(self, rel: str) -> int | None:
        """Size in bytes of ``rel`` (``step-N/<name>``), or None when it does not exist."""

    @abstractmethod
    def names_in(self, step: int) -> list[str]:
        """Names under ``step-N/``, committed or not, sorted (tools, tests)."""

    # -- owning: the caller's thread, once at start-up and once at close ----------------------
    @abstractmethod
    def own(self, timeout_s: float | None = None) -> list[str]:
        """[owner] Take the root (RootLockedError names the holder), then finish or remove what
        a crash left; returns the actions taken."""

    @abstractmethod
    def release(self) -> None:
        """[owner] Stop owning the root (idempotent)."""

    # -- writing: the owner's persist/replicator thread, one step at a time per thread --------
    @abstractmethod
    def begin(self, step: int) -> str:
        """[owner] Open ``step``'s staging area, never visible to readers; returns its location."""

    @abstractmethod
    def open_shard_write(self, step: int, name: str, nbytes: int, engine: "Engine | None" = None) -> "ShardFile":
        """A ShardFile-like writer of shard ``name`` (``nbytes``) in ``step``'s staging area:
        ``write(extents)``, ``finish()`` (durable), ``close()``."""

    @abstractmethod
    def commit(self, step: int, manifest: "Manifest", overwrite: bool = False) -> tuple[str, ...]:
        """Make ``step`` committed atomically; shards must already be durable. Raises if nothing
        was committed; returns the problems met after the commit point (logged, never a failed
        save)."""

    @abstractmethod
    def abort(self, step: int) -> None:
        """[owner] Discard ``step``'s staging area (never a committed step)."""

    @abstractmethod
    def delete(self, step: int) -> None:
        """[owner] Remove committed ``step``: uncommit it first, so no reader sees it torn."""

    @abstractmethod
    def put_bytes(self, data: bytes, rel: str) -> None:
        """[owner] Store ``data`` as ``rel`` as is, durably."""


# -- registry ----------------------------------------------------------------------------

_SCHEMES: dict[str, tuple[str, str]] = {
    "s3": ("zerostall.store.s3:S3Tier", "install zerostall[s3] (boto3) for s3:// URLs"),
    "file": ("zerostall.store.sharedfs:FileTier", ""),
    "": ("zerostall.store.sharedfs:FileTier", ""),
}


def register_tier(scheme: str, target: str, hint: str = "") -> None:
    """Serve ``scheme://`` URLs with the class at ``target`` (``"module:Class"``, imported lazily);
    ``hint`` is shown when the import fails (e.g. which extra to install)."""
    _SCHEMES[scheme] = (target, hint)


def is_url(path: Any) -> bool:
    """Whether ``path`` names a tier by URL (``scheme://...``) rather than a local directory."""
    return "://" in str(path)


def open_tier(url: str, **kwargs: Any) -> Any:
    """The tier for ``url`` (``s3://bucket/prefix``, ``file:///path`` or a plain path: a
    shared-filesystem tier); ``kwargs`` go to its constructor (``io=``, ...)."""
    scheme = urlparse(url).scheme if "://" in url else ""
    if scheme not in _SCHEMES:
        known = ", ".join(s + "://" for s in sorted(_SCHEMES) if s)
        raise ConfigError(f"no tier for {scheme}:// URLs (known: {known} "
                          "or a plain path); register one with zerostall.store.tier.register_tier")
    target, hint = _SCHEMES[scheme]
    try:
        cls = load_target(target)
    except ImportError as exc:
        raise ConfigError(f"{url}: {hint or exc}") from exc
    return cls(url, **kwargs)
