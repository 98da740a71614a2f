"""Replacing a committed step on a remote tier: never absent, never torn, crash-safe.

A remote step's data objects live at fixed names, the local ones (``step-N/rank-R.shard``):
later incremental steps reference them by name, and object stores cannot rename. So instead
of uploading the new copy under other names, rank 0's replicator first moves the *old* copy
out of the way, committed at every moment, and then the new copy goes to the usual names::

    1. each old data object -> <name>.old-<tag>   server-side copy / hard link, verified ("aside_copy")
    2. put the old manifest, rewritten to name those copies                       ("aside_commit")
    3. delete the old objects at the usual names (rank 0's own files)             ("aside_unlink")
    4. every rank uploads its new objects at the usual names (verified); rank 0
       puts the new manifest: the commit point                                    (replicator)
    5. delete every object of step-N the new manifest does not name               ("sweep")

Every state between two requests is a committed step: until 2 the old manifest names the old
objects; from 2 to 4 the rewritten one names the copies (the usual names are referenced by no
manifest, so overwriting them tears nothing); from 4 the new manifest names the new objects.
The next pass finishes a crash: files set aside are not copied again. Ranks other than 0
upload a file only once the remote manifest no longer names it (:func:`live_names`).
Called from the replicator thread (rank 0 for :func:`set_aside`/:func:`sweep`), or through
:meth:`RemoteTier.begin`/``commit``.
"""

from __future__ import annotations

import dataclasses
import hashlib
import logging
import re
from typing import TYPE_CHECKING, Callable

from ..errors import CheckpointNotFound, CorruptCheckpoint
from ..format.manifest import MANIFEST_NAME, FileEntry, Manifest
from ..format.layout import HEADER_BYTES, ShardHeader
from ..memory.arena import Arena

if TYPE_CHECKING:
    from .remote import RemoteTier

log = logging.getLogger("zerostall")
_ASIDE_RE = re.compile(r"\.old-[0-9a-f]{16}$")


def aside_name(name: str, checkpoint_id: str) -> str:
    """Where the data object ``name`` of checkpoint ``checkpoint_id`` waits while its step is
    replaced (a valid manifest file name: at most 128 characters)."""
    tag = hashlib.sha1(f"{checkpoint_id}/{name}".encode()).hexdigest()[:16]
    return f"{name[:100]}.old-{tag}"


def is_aside(name: str) -> bool:
    return bool(_ASIDE_RE.search(name))


def committed(remote: "RemoteTier", step: int) -> tuple[bytes | None, Manifest | None]:
    """``step``'s remote manifest as (bytes, parsed) if it validates, else (None, None)."""
    try:
        return remote.read_manifest_raw(step)
    except (CheckpointNotFound, CorruptCheckpoint):
        return None, None


def live_names(remote: "RemoteTier", step: int, checkpoint_id: str) -> set[str]:
    """Data objects of ``step`` that a remote manifest of *another* checkpoint names: nobody
    may write them before rank 0 has set that checkpoint aside."""
    if remote.stat(f"step-{step}/{MANIFEST_NAME}") is None:
        return set()
    theirs = committed(remote, step)[1]
    if theirs is None or theirs.checkpoint_id == checkpoint_id:
        return set()
    return {f.name for f in theirs.files}


def refs_current(remote: "RemoteTier", manifest: Manifest) -> bool:
    """Whether every file ``manifest`` borrows from an earlier step is, on the remote, the one it
    recorded (file id and size); else committing it would commit a torn step. Rank 0's check."""
    theirs: dict[int, Manifest | None] = {}
    for r in manifest.ref_files:
        if r.step not in theirs:
            theirs[r.step] = committed(remote, r.step)[1]
        man = theirs[r.step]
        fe = None if man is None else {f.name: f for f in man.files}.get(r.name)
        if fe is None or fe.file_bytes != r.file_bytes or (fe.file_id or man.checkpoint_id) != r.file_id:
            log.info("zerostall: %s: step %d borrows step-%d/%s, which the remote holds as another checkpoint's; "
                     "not uploading it before that step is replaced", remote.url, manifest.step, r.step, r.name)
            return False
    return True


def set_aside(remote: "RemoteTier", step: int, mine: Callable[[FileEntry], bool] = lambda fe: True) -> None:
    """Steps 1-3: the remote's committed ``step`` keeps being the old checkpoint, whole, under
    names nobody writes; then the usual names of the files ``mine`` selects are removed (the
    caller uploads those next). Idempotent: a step already set aside is left as it is."""
    raw, theirs = committed(remote, step)
    if theirs is None:
        return
    todo = [fe for fe in theirs.files if not is_aside(fe.name)]
    if not todo:
        return
    renamed: dict[str, str] = {}
    for fe in theirs.files:
        new = fe.name if is_aside(fe.name) else aside_name(fe.name, theirs.checkpoint_id)
        renamed[fe.name] = new
        if new != fe.name:
            try:
                remote.copy_object(f"step-{step}/{fe.name}", f"step-{step}/{new}", fe.file_bytes)
            except CorruptCheckpoint as exc:  # the old copy is damaged: nothing worth keeping
                log.warning("zerostall: %s: step %d cannot be set aside (%s); removing it before it is replaced",
                            remote.url, step, exc)
                remote.delete(step)
                return
            remote.hook("aside_copy")
    moved = dataclasses.replace(
        theirs, files=tuple(dataclasses.replace(fe, name=renamed[fe.name]) for fe in theirs.files),
        tensors=tuple(e if e.step is not None else dataclasses.replace(e, file=renamed[e.file])
                      for e in theirs.tensors), tree_json="")
    remote.upload_bytes(moved.to_bytes(), f"step-{step}/{MANIFEST_NAME}", previous=raw)  # the old checkpoint, whole
    remote.hook("aside_commit")
    log.info("zerostall: %s: step %d (checkpoint %s) set aside while it is replaced", remote.url, step,
             theirs.checkpoint_id)
    for fe in todo:
        if mine(fe):
            remote._delete(f"step-{step}/{fe.name}")
            remote.hook("aside_unlink")


def others_are_current(remote: "RemoteTier", step: int, manifest: Manifest, rank: int, world_size: int) -> bool:
    """Whether every other rank's data object of ``step`` is the one ``manifest`` names, by its
    header read back (size alone cannot tell). Rank 0 checks before it puts the manifest."""
    buf = Arena(HEADER_BYTES, mlock=False)
    try:
        for fe in manifest.files:
            if fe.rank % world_size == rank:
                continue  # ours: verified by crc32c when uploaded
            rel = f"step-{step}/{fe.name}"
            want = ShardHeader(fe.file_id or manifest.checkpoint_id, step, fe.rank, fe.file_bytes)
            with remote.open_shard_read(step, fe.name) as r:
                r.read([(0, buf.mv[:HEADER_BYTES])])
            try:
                ShardHeader.check(buf.mv, want, remote.where(rel))
            except CorruptCheckpoint:
                log.info("zerostall: %s holds another checkpoint's object (not yet replaced by rank %d)",
                         remote.where(rel), fe.rank)
                return False
    finally:
        buf.close()
    return True


def sweep(remote: "RemoteTier", step: int, manifest: Manifest) -> list[str]:
    """Step 5: delete (and return) the objects of ``step`` that the committed ``manifest`` does not name."""
    keep = {f.name for f in manifest.files} | {MANIFEST_NAME}
    gone = sorted(n for n in remote.names_in(step) if n not in keep)
    for n in gone:
        remote._delete(f"step-{step}/{n}")
        remote.hook("sweep")
    if gone:
        log.info("zerostall: %s: removed %d objects of step %d that its manifest does not name: %s", remote.url,
                 len(gone), step, ", ".join(gone[:8]))
    return gone
