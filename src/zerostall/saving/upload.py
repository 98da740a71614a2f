"""The replicator thread: makes the remote tier hold what the local tier holds, then
applies retention on both tiers.

One daemon thread per ``Checkpointer`` with a remote tier, at idle I/O priority under a
bandwidth cap. Each *pass*:

1. lists the remote tier's committed steps (the listing, never memory, is the truth); a local
   step the remote holds as another checkpoint is replaced (:mod:`..store.remote_replace`);
2. for every local committed step the remote lacks and would keep (oldest first, a step after
   those it references), uploads this rank's shard files, each verified by crc32c read back;
   rank 0 then waits (``rank_wait_s``) for every rank's shard and uploads the manifest last;
3. marks this run's handles whose step the remote now lists as replicated;
4. applies retention on both tiers (never a step that a step staying there references).

A pass runs at start-up, after each local commit and, while steps are pending, after a backoff;
a failed request stops the pass (the step stays pending). When passes run, ``close()``'s
deadline, what the next run uploads: docs/remote.md ("When the remote is down").

Threads: ``on_committed`` from the persist thread (a commit subscriber), ``close`` and
``pending_steps`` from the caller's; everything else on the replicator thread.
"""

from __future__ import annotations

import logging
import os
import random
import threading
import time
from typing import Callable

from ..errors import CorruptCheckpoint, RemoteError, ZerostallError
from ..format.manifest import MANIFEST_NAME, MAX_MANIFEST_BYTES, Manifest
from ..format.validate import read_small
from .job import Committed
from ..store.local import LocalTier
from ..store.files import drop_cache, file_crc32c
from ..store.remote import RemoteTier
from ..store.remote_replace import (committed, live_names, others_are_current, refs_current, set_aside,
    sweep)
from ..store.retention import RetentionPolicy, dependents, prune
from ..io._sys import set_idle_io_priority

log = logging.getLogger("zerostall")


class Replicator:
    def __init__(self, tier: LocalTier, make_remote: Callable[[], RemoteTier], policy: RetentionPolicy, *,
                 rank: int = 0, world_size: int = 1, local_retention: bool = True, retry_max_s: float = 60.0,
                 rank_wait_s: float = 30.0, start: bool = True, protect: Callable[[], set[int]] | None = None):
        self.tier = tier
        self.protect = protect or set
        """Local steps a save in flight may still reference (``RefTracker.protected``)."""
        self.make_remote = make_remote
        self.policy = policy
        self.rank, self.world_size = rank, world_size
        self.local_retention = local_retention
        self.retry_max_s = retry_max_s
        self.rank_wait_s = rank_wait_s
        self.remote: RemoteTier | None = None
        self.last_error: BaseException | None = None
        self._lock = threading.Lock()
        self._jobs: dict[int, Committed] = {}  # this run's commits not replicated yet
        self._recheck: set[int] = set()  # overwritten steps: the remote copy may be the old one
        self._matched: dict[int, str] = {}  # step -> checkpoint id both tiers hold (replicator thread)
        self._pending: list[int] = []
        self._wake = threading.Event()
        self._stopping = threading.Event()
        self._cancel = threading.Event()
        self._failing = False
        self._root_ok = False
        self._thread = threading.Thread(target=self._run, name="zerostall-replicate", daemon=True)
        if start:
            self._thread.start()

    # -- any thread --------------------------------------------------------------------------
    name = "replication"

    def on_committed(self, record: Committed) -> None:
        """A step was committed locally (a commit subscriber: persist thread)."""
        with self._lock:
            self._jobs[record.step] = record
            if record.overwrite:
                self._recheck.add(record.step)
        self._wake.set()

    def pending_steps(self) -> list[int]:
        """Local steps known not to be on the remote tier yet (plus this run's unreplicated saves)."""
        with self._lock:
            return sorted(set(self._pending) | {s for s, j in self._jobs.items() if not j.status.replicated.is_set()})

    def close(self, timeout_s: float) -> list[int]:
        """One last pass, for at most ``timeout_s``; then abandon in-flight transfers. Returns the
        steps not replicated (logged, and recorded on their handles as ``replication_error``)."""
        self._stopping.set()
        self._wake.set()
        if self._thread.ident is not None:
            self._thread.join(timeout_s)
        if self._thread.is_alive():
            self._cancel.set()
            if self.remote is not None:
                self.remote.cancel()
        pending = self.pending_steps()
        url = self._url()
        last = f"; last error: {self.last_error}" if self.last_error else ""
        if pending:
            log.warning("zerostall: steps %s not replicated to %s within close_timeout_s=%g s%s; they stay in %s "
                        "and the next Checkpointer with this remote uploads them", pending, url, timeout_s, last,
                        self.tier.root)
        with self._lock:
            jobs = list(self._jobs.values())
        for job in jobs:
            if not job.status.replicated.is_set():
                job.status.mark_replicated(RemoteError(
                    f"step {job.step} was not replicated to {url} before close (close_timeout_s={timeout_s:g}){last}"
                    f"; the local copy is kept and the next Checkpointer on {self.tier.root} uploads it",
                    url=url, step=job.step))
        return pending

    def _url(self) -> str:
        return self.remote.url if self.remote is not None else "the remote tier"

    # -- replicator thread ------------------------------------------------------------------
    def _run(self) -> None:
        set_idle_io_priority()
        delay: float | None = 0.0
        idle_passes = 0
        while True:
            if delay is None or delay > 0:
                self._wake.wait(delay)
            self._wake.clear()
            if self._cancel.is_set():
                return
            last = self._stopping.is_set()  # close() was called before this pass began: the last one
            try:
                progressed = self._pass()
            except Exception as exc:  # noqa: BLE001 - the thread must survive anything
                log.exception("zerostall: replication pass failed")
                self.last_error, progressed = exc, False
            if last or self._cancel.is_set():
                return
            if self._stopping.is_set():
                delay = 0.0
                continue
            if not self.pending_steps():
                delay, idle_passes = None, 0
                continue
            idle_passes = 0 if progressed else idle_passes + 1
            delay = random.uniform(0.5, 1.0) * min(self.retry_max_s, 2.0 ** idle_passes)

    def _note_error(self, exc: BaseException) -> None:
        self.last_error = exc
        with self._lock:
            for job in self._jobs.values():
                if not job.status.replicated.is_set():
                    job.status.replicate_error = exc
        if not self._failing:
            log.warning("zerostall: replication to %s failed (%s); local saves go on, pending steps are "
                        "retried with backoff", self._url(), exc)
        else:
            log.debug("zerostall: replication still failing: %s", exc)
        self._failing = True

    def _remote_tier(self) -> RemoteTier:
        if self.remote is None:
            self.remote = self.make_remote()
            if self._cancel.is_set():
                self.remote.cancel()
        if not self._root_ok:  # the bucket/directory, created once it can be
            self.remote.own()
            self._root_ok = True
        return self.remote

    def _pass(self) -> bool:
        """One reconciliation; True if some step got committed on the remote."""
        try:
            remote = self._remote_tier()
            remote_steps = set(remote.steps())
            local = self.tier.steps()
            blocked = self._drop_stale(remote, remote_steps, local)
        except ZerostallError as exc:
            self._note_error(exc)
            return False
        self._settle((remote_steps - blocked).__contains__, f"replicated to {self._url()}")
        todo = self.policy.to_replicate(local, sorted(remote_steps))
        with self._lock:
            self._pending = list(todo)
        # saved this run, but older than anything remote retention keeps: settled, never uploaded
        self._settle(lambda s: s in local and s not in todo and s not in remote_steps and s not in blocked,
                     f"not uploaded to {self._url()}: remote retention would not keep it")
        progressed = False
        for s in todo:
            if self._cancel.is_set():
                return progressed
            try:
                if self._replicate_step(remote, s):
                    remote_steps.add(s)
                    progressed = True
                    self._settle({s}.__contains__, f"replicated to {self._url()}")
            except RemoteError as exc:
                self._note_error(exc)
                return progressed
            except (ZerostallError, OSError) as exc:  # the local copy is gone or damaged: skip it
                log.error("zerostall: cannot replicate step %d from %s: %s", s, self.tier.root, exc)
                with self._lock:
                    job = self._jobs.get(s)
                if job is not None:
                    job.status.replicate_error = exc
        if self._failing:
            log.info("zerostall: replication to %s works again", remote.url)
        self._failing = False
        self.last_error = None
        with self._lock:
            self._pending = sorted({s for s in todo if s not in remote_steps} | blocked)
            pending = list(self._pending)
        self._retain(remote, local, sorted(remote_steps), pending)
        return progressed

    def _drop_stale(self, remote: RemoteTier, remote_steps: set[int], local: list[int]) -> set[int]:
        """A local step the remote lists under another checkpoint id is not replicated: the
        remote holds an older copy. Rank 0 sets that copy aside; the step then counts as
        missing and is uploaded. Each step is compared once per local copy, so a stale remote
        copy can never mark a new save replicated, nor let local retention delete the only
        copy of its bytes. Returns the steps neither replaced nor replicated (referenced there)."""
        with self._lock:
            recheck, self._recheck = self._recheck, set()
        for s in recheck:
            self._matched.pop(s, None)
        blocked: set[int] = set()  # stale on the remote but referenced there: neither replaced nor replicated
        for s in sorted(remote_steps & set(local)):
            mine = self._local_id(s)
            if mine is None:
                continue  # deleted meanwhile (retention)
            if self._matched.get(s) == mine:
                continue
            their_man = remote.read_manifest(s)
            theirs = their_man.checkpoint_id
            if theirs == mine:
                if self.rank == 0:  # once per step and run: what an interrupted replacement left
                    sweep(remote, s, their_man)
                self._matched[s] = mine
                continue
            users = dependents(sorted(remote_steps), s, remote.read_manifest)
            if users:  # replacing it would break them: keep both copies until remote retention drops them
                log.warning("zerostall: %s holds another checkpoint as step %d (id %s, local id %s), and its "
                            "steps %s borrow bytes from it: the local step stays, not replicated, until they "
                            "are gone", remote.url, s, theirs, mine, users)
                blocked.add(s)
                continue
            log.warning("zerostall: %s holds another checkpoint as step %d (id %s, local id %s); replacing it "
                        "with the local step", remote.url, s, theirs, mine)
            if self.rank == 0:  # the old copy stays committed (set aside) until the new manifest is up
                set_aside(remote, s, mine=lambda fe: fe.rank % self.world_size == self.rank)
            remote_steps.discard(s)
        return blocked

    def _settle(self, which: Callable[[int], bool], why: str) -> None:
        """The handles of this run's steps ``which`` selects are done replicating (logged: ``why``)."""
        with self._lock:
            done = [j for s, j in self._jobs.items() if which(s) and not j.status.replicated.is_set()]
            for j in done:
                del self._jobs[j.step]
        for j in done:
            j.status.mark_replicated(None)
            log.info("zerostall: step %d %s", j.step, why)

    def _wait_for(self, cond: Callable[[], bool]) -> bool:
        """Poll ``cond`` for up to ``rank_wait_s`` (other ranks' uploads), unless cancelled."""
        deadline = time.monotonic() + self.rank_wait_s
        while not cond():
            if time.monotonic() > deadline or self._cancel.wait(0.5):
                return False
        return True

    def _replicate_step(self, remote: RemoteTier, step: int) -> bool:
        """Upload this rank's files of ``step`` (verified); rank 0 then commits it with the
        manifest. True once the remote holds the manifest."""
        d = self.tier.step_dir(step)
        raw = read_small(os.path.join(d, MANIFEST_NAME), MAX_MANIFEST_BYTES)
        man = Manifest.from_bytes(raw, where=os.path.join(d, MANIFEST_NAME))
        if man.step != step:
            raise CorruptCheckpoint(f"{d}: manifest says step {man.step}", path=d)
        for ref in sorted({r.step for r in man.ref_files}):  # the steps whose files this one borrows
            if remote.stat(f"step-{ref}/{MANIFEST_NAME}") is None and not self._replicate_step(remote, ref):
                return False
        if man.ref_files and not refs_current(remote, man):  # it would borrow another checkpoint's bytes
            return False
        rel = f"step-{step}"
        live = live_names(remote, step, man.checkpoint_id)  # names another checkpoint's manifest holds there
        for fe in man.files:
            path = os.path.join(d, fe.name)
            if fe.rank % self.world_size != self.rank or not os.path.exists(path):
                continue  # another rank's (or another node's) file
            if fe.name in live:  # rank 0 sets that checkpoint aside first (remote_replace)
                log.info("zerostall: step %d: %s still names %s of another checkpoint; uploading later", step,
                         remote.url, fe.name)
                return False
            if self._cancel.is_set():
                return False
            size, crc = file_crc32c(path)
            if size != fe.file_bytes:
                raise CorruptCheckpoint(f"{path}: {size} bytes, the manifest says {fe.file_bytes}", path=path)
            if remote.stat(f"{rel}/{fe.name}") == size:
                try:  # uploaded by an earlier pass or run: check, keep
                    remote.verify(f"{rel}/{fe.name}", size, crc)
                    continue
                except RemoteError as exc:
                    log.warning("zerostall: %s; uploading it again", exc)
            remote.upload(path, f"{rel}/{fe.name}", crc)
            remote.hook("upload")
            drop_cache(path)
        manifest_rel = f"{rel}/{MANIFEST_NAME}"
        if self.rank != 0:
            return self._wait_for(lambda: remote.stat(manifest_rel) is not None)
        if not self._wait_for(lambda: all(remote.stat(f"{rel}/{fe.name}") == fe.file_bytes for fe in man.files)) \
                or not others_are_current(remote, step, man, self.rank, self.world_size):
            log.info("zerostall: step %d: not every rank's shard is on %s yet; trying again later", step, remote.url)
            return False
        if self._local_id(step) != man.checkpoint_id:  # the files uploaded may be the new copy's: not committed
            log.info("zerostall: step %d was overwritten locally while it was uploaded; uploading it again "
                     "at the next pass", step)
            return False
        remote.upload_bytes(raw, manifest_rel, previous=committed(remote, step)[0])  # last: the remote commit
        remote.hook("commit")
        try:  # after the commit point: a replaced copy (set aside) goes
            sweep(remote, step, man)
        except ZerostallError as exc:
            log.warning("zerostall: step %d is committed on %s, but removing the objects it replaced failed (%s); "
                        "the next run removes them", step, remote.url, exc)
        return True

    def _local_id(self, step: int) -> str | None:
        """The checkpoint id of the local ``step`` now (None if it is gone or unreadable)."""
        try:
            return self.tier.read_manifest(step).checkpoint_id
        except (ZerostallError, OSError):
            return None

    def _retain(self, remote: RemoteTier, local: list[int], remote_steps: list[int], pending: list[int]) -> None:
        """Retention from the listing: a local step goes only if the remote holds it or does
        not want it; the remote keeps ``keep_last_remote`` (+ every ``keep_every_remote``-th)."""
        try:
            if self.local_retention:
                doomed = self.policy.local_doomed(local, set(local) - set(pending))
                prune(self.tier, local, doomed, protect=self.protect(), cancelled=self._cancel.is_set)
            if self.rank == 0 and not self._cancel.is_set():
                prune(remote, remote_steps, self.policy.remote_doomed(remote_steps), cancelled=self._cancel.is_set)
        except (ZerostallError, OSError) as exc:  # retention must not stop replication
            log.warning("zerostall: retention failed: %s", exc)

