"""The copies a node keeps for its peers under ``root/peers`` (nothing outside it), and the files
it may serve::

    peers/<src node>/step-<N>/manifest.json      written (durably) before any file of the step
    peers/<src node>/step-<N>/rank-RRRRR.shard   a file of <src node>'s ranks, complete and verified
    peers/<src node>/step-<N>/.incoming-*        a transfer in flight (removed at start-up)

A file is held once its final name exists: received into ``.incoming-*`` with O_DIRECT, every
byte checked (:class:`.verify.StreamCheck`), fdatasync'ed, renamed, the directory fsync'ed. A
new checkpoint under a step number already held replaces the old copy as a whole. Threads: the
server's connection threads and the replicator's (retention); one lock per ``(src, step)``.
"""

from __future__ import annotations

import logging
import os
import shutil
import threading
import uuid
from typing import Any, Callable, TypeVar

from ..errors import ZerostallError
from ..format.manifest import MANIFEST_NAME, Manifest
from ..io.base import Engine
from ..store.atomic import fsync_dir, unlinked_on_error, write_file_durable
from ..store.local import LocalTier
from .status import area_bytes, drop_dir, file_size as _size, held_dirs
from .stream import at
from .tombstones import read_manifest
from .verify import StreamCheck, file_entry
from .wire import PeerError, check_node

log = logging.getLogger("zerostall")
AREA = "peers"
T = TypeVar("T")


class QuotaExceeded(ZerostallError):
    """A copy would take this holder's peer area beyond ``peers.quota_bytes`` / ``quota_fraction``."""


def quota_for(root: str, quota_bytes: int | None, quota_fraction: float | None) -> int | None:
    """The byte limit of ``root``'s peer area (the smaller of the two; None: none)."""
    limits = [quota_bytes] if quota_bytes is not None else []
    if quota_fraction is not None:
        st = os.statvfs(root)
        limits.append(int(st.f_blocks * st.f_frsize * quota_fraction))
    return min(limits) if limits else None


class PeerStore:
    def __init__(self, tier: LocalTier, me: str, engine_for: Callable[[], Engine], quota_bytes: int | None = None):
        self.tier, self.me = tier, me
        self.area = os.path.join(tier.root, AREA)
        self._engine_for = engine_for
        self._mu = threading.Lock()
        self._locks: dict[tuple[str, int], threading.Lock] = {}
        self.quota_bytes = quota_bytes
        self._reserved = 0  # bytes of transfers in flight (counted against the quota)
        self.refused_quota = 0  # copies refused for the quota (tests, doctor)

    def step_dir(self, src: str, step: int) -> str:
        return os.path.join(self.area, check_node(src), f"step-{step}")

    def _lock(self, src: str, step: int) -> threading.Lock:
        with self._mu:
            return self._locks.setdefault((src, step), threading.Lock())

    # -- holding -----------------------------------------------------------------------
    def clean(self) -> list[str]:
        """Remove transfers a crash interrupted (start-up, before the server listens)."""
        gone = []
        if os.path.isdir(self.area):
            for name in os.listdir(self.area):
                if name.startswith(".deleting-"):
                    shutil.rmtree(os.path.join(self.area, name), ignore_errors=True)
                elif name.endswith(".tmp"):  # a status hint whose write a crash interrupted
                    os.unlink(os.path.join(self.area, name))
        for _, _, d in held_dirs(self.tier.root):
            for name in os.listdir(d):
                if name.startswith(".incoming-"):
                    os.unlink(os.path.join(d, name))
                    gone.append(os.path.join(d, name))
        if gone:
            log.info("zerostall: removed %d interrupted peer transfers under %s", len(gone), self.area)
        return gone

    def manifest(self, src: str, step: int) -> Manifest | None:
        return read_manifest(self.step_dir(src, step))

    def _own(self, step: int) -> Manifest | None:
        try:
            return self.tier.read_manifest(step)
        except ZerostallError:
            return None

    def held(self) -> list[dict[str, Any]]:
        """``[{src, step, checkpoint_id, created_unix, files}]``: the complete files of the peer
        copies held and of this node's own committed steps (``src`` = this node, ``local``)."""
        found = [(src, step, d, read_manifest(d), {}) for src, step, d in held_dirs(self.tier.root)]
        found += [(self.me, step, self.tier.step_dir(step), self._own(step), {"local": True})
                  for step in self.tier.steps()]
        out = []
        for src, step, d, man, extra in found:
            files = [fe.name for fe in man.files if _size(os.path.join(d, fe.name)) == fe.file_bytes] \
                if man is not None and man.step == step else []
            if files:
                out.append({"src": src, "step": step, "checkpoint_id": man.checkpoint_id, "files": files,
                            "created_unix": man.created_unix, **extra})
        return out

    def path_for(self, src: str, step: int, name: str) -> tuple[str, Manifest] | None:
        """A committed file this node may serve (``name`` checked by the caller), with its step's
        manifest; None otherwise."""
        own = src == self.me and step in self.tier.steps()
        man = self._own(step) if own else self.manifest(src, step)
        path = os.path.join(self.tier.step_dir(step) if own else self.step_dir(src, step), name)
        fe = next((fe for fe in man.files if fe.name == name), None) if man is not None and man.step == step else None
        return (path, man) if fe is not None and _size(path) == fe.file_bytes else None

    def receive(self, src: str, step: int, name: str, man_bytes: bytes, size: int,
                fill: Callable[[Any, StreamCheck], None]) -> str:
        """Keep ``name`` of ``src``'s ``step`` (``size`` bytes announced): ``fill(writer, check)``
        streams the bytes in through ``check``; returns the digest. Raises on any mismatch, leaving
        nothing behind."""
        man = Manifest.from_bytes(man_bytes)
        if man.step != step:
            raise ZerostallError(f"the manifest names step {man.step}, the request step {step}")
        fe = file_entry(man, name)
        if fe.file_bytes != size:
            raise PeerError(f"{name}: {size} bytes announced, the manifest says {fe.file_bytes}")
        def same(held: Manifest | None) -> bool:  # else the source overwrote the step
            return held is not None and held.checkpoint_id == man.checkpoint_id

        self.open_step(src, step, man, same)
        check = StreamCheck(man, name, f"{src}:step-{step}/{name}")

        def write(w: Any) -> str:
            fill(w, check)
            return check.digest()
        return self.keep(src, step, name, fe.file_bytes, write, lambda: same(self.manifest(src, step)), "recv")

    def open_step(self, src: str, step: int, man: Manifest, same: Callable[[Manifest], bool],
                  first: tuple[tuple[str, bytes], ...] = ()) -> None:
        """The directory of ``src``'s ``step`` ready for a file of ``man``, under the step's lock: a
        copy whose manifest is not ``same`` goes; a new one gets ``first`` (name, bytes) files,
        then the manifest, durably (connection thread)."""
        d = self.step_dir(src, step)
        with self._lock(src, step):
            old = self.manifest(src, step)
            if old is not None and not same(old):
                drop_dir(self.step_dir(src, step))
                old = None
            os.makedirs(d, exist_ok=True)
            if old is None:
                for name, data in first:
                    write_file_durable(os.path.join(d, name), data)
                write_file_durable(os.path.join(d, MANIFEST_NAME), man.to_bytes())
                fsync_dir(d)
                fsync_dir(os.path.dirname(d))

    def keep(self, src: str, step: int, name: str, nbytes: int, write: Callable[[Any], T],
             same: Callable[[], bool], hooks: str) -> T:
        """After :meth:`open_step`: reserve ``nbytes`` of the quota, ``write(writer)`` into an
        ``.incoming-*`` file, fdatasync, rename it to ``name`` under the step's lock if the step is
        still ``same()``; returns what ``write`` returned. A failure leaves nothing behind.
        ``hooks``: the fault-hook prefix (connection thread)."""
        d = self.step_dir(src, step)
        self._reserve(src, step, name, nbytes)
        engine = self._engine_for()
        try:
            with unlinked_on_error(os.path.join(d, f".incoming-{name}-{uuid.uuid4().hex[:8]}")) as tmp:
                w = engine.open_write(tmp, nbytes)
                try:
                    out = write(w)
                    at(f"{hooks}:before-fsync")
                    w.finish()
                finally:
                    w.close()
                at(f"{hooks}:before-rename")
                with self._lock(src, step):
                    if not same():
                        raise ZerostallError(f"step {step} of {src} was replaced during the transfer")
                    os.rename(tmp, os.path.join(d, name))
                    fsync_dir(d)
        finally:
            engine.close()
            with self._mu:
                self._reserved -= nbytes
        return out

    def used_bytes(self) -> int:
        return area_bytes(self.tier.root)

    def usage(self) -> dict[str, Any]:
        """This node's peer area (published with each step's report): ``used_bytes``,
        ``quota_bytes``, ``next_bytes`` (the newest held step of every source: the room the next
        round of copies needs on top, as older copies go only later), ``refused`` (for the quota)."""
        newest: dict[str, tuple[int, str]] = {}
        for src, step, d in held_dirs(self.tier.root):
            if step > newest.get(src, (-1, ""))[0]:
                newest[src] = (step, d)
        nxt = 0
        for _, d in newest.values():
            try:
                nxt += sum(max(_size(os.path.join(d, f)), 0) for f in os.listdir(d)
                           if f.endswith(".shard") or f.startswith("fragment-"))  # a coded copy's fragment
            except OSError:
                pass
        return {"used_bytes": self.used_bytes(), "quota_bytes": self.quota_bytes, "next_bytes": nxt,
                "refused": self.refused_quota}

    def _reserve(self, src: str, step: int, name: str, nbytes: int) -> None:
        with self._mu:
            if self.quota_bytes is not None:
                old = _size(os.path.join(self.step_dir(src, step), name))  # replaced by the new copy
                used = self.used_bytes() + self._reserved - max(old, 0)
                if used + nbytes > self.quota_bytes:
                    self.refused_quota += 1
                    log.warning("zerostall: node %s refuses %s of step %d from node %s: %d bytes would take its "
                                "peer copies to %d bytes, beyond its quota of %d (peers.quota_bytes / "
                                "peers.quota_fraction); that step is protected only if another node takes it",
                                self.me, name, step, src, nbytes, used + nbytes, self.quota_bytes)
                    raise QuotaExceeded(f"node {self.me}'s quota for peer copies ({self.quota_bytes} bytes) would be "
                                        f"exceeded: {used} held, {nbytes} more asked")
            self._reserved += nbytes

    def retain(self, keep: set[int], below: int) -> list[tuple[str, int]]:
        """Delete held steps lower than ``below`` not in ``keep`` (any source) nor referenced,
        transitively, by a step of the same source that stays (incremental)."""
        gone = []
        dirs = [(src, step) for src, step, _ in held_dirs(self.tier.root)]
        spared: set[tuple[str, int]] = set()
        todo = [(src, step) for src, step in dirs if step >= below or step in keep]
        while todo:
            src, step = todo.pop()
            man = self.manifest(src, step)
            for ref in {r.step for r in man.ref_files} if man is not None else ():
                if (src, ref) not in spared:
                    spared.add((src, ref))
                    todo.append((src, ref))
        for src, step in dirs:
            if step < below and step not in keep and (src, step) not in spared:
                with self._lock(src, step):
                    drop_dir(self.step_dir(src, step))
                gone.append((src, step))
        if gone:
            log.info("zerostall: retention removed peer copies %s from %s", gone, self.area)
        return gone
