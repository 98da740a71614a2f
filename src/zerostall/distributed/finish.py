"""The disk side of one copy of the root in the cross-rank commit (:mod:`.commit`): recording
the decision (RECORDING) and the renames that make the step durable (RECORDED -> DURABLE).

Persist thread of a copy's leader, or of a rank taking over from a stopped leader; both
functions are idempotent and safe to race (each file goes in by rename; a copy already
renamed with the decided checkpoint id is done). Crash states: before RECORDING only
``step-N.partial`` exists (start-up recovery removes it); from RECORDING on, a
``step-N.partial`` holding ``manifest.decided`` is committed (recovery completes it). An
overwrite records nothing: the local tier's overwrite protocol, by the copy's leader only.
"""

from __future__ import annotations

import os
import uuid

from ..errors import CheckpointExistsError, ZerostallError, storage_error
from ..format.manifest import MANIFEST_NAME, Manifest
from ..store.atomic import fsync_dir, unlinked_on_error, write_file_durable
from ..store.recovery import DECIDED_NAME
from ..store.local import LocalTier


def record_decision(tier: LocalTier, step: int, manifest: bytes) -> None:
    """RECORDING: the decided manifest into ``step-N.partial/manifest.decided``, durably (tmp +
    rename, fsync of the directory, which also makes the shards' entries durable)."""
    part = tier.partial_dir(step)
    rec = os.path.join(part, DECIDED_NAME)
    if os.path.exists(rec) or committed_here(tier, step, Manifest.from_bytes(manifest).checkpoint_id):
        return
    try:
        _write_as(part, manifest, rec)
        fsync_dir(part)
    except OSError as exc:
        raise storage_error(f"recording the commit decision of step {step} in", tier.root, exc) from exc


def finish_copy(tier: LocalTier, step: int, manifest: bytes, *, overwrite: bool = False,
                leader: bool = True) -> tuple[str, ...]:
    """Commit ``step`` in this copy of the root with ``manifest``. Returns post-commit problems
    (the leader writes ``latest``)."""
    man = Manifest.from_bytes(manifest)
    if overwrite:
        return tier.commit(step, man, overwrite=True)
    part, final = tier.partial_dir(step), tier.step_dir(step)
    rec = os.path.join(part, DECIDED_NAME)
    try:
        if not committed_here(tier, step, man.checkpoint_id):
            if os.path.exists(rec):  # recorded: the record becomes the manifest
                os.rename(rec, os.path.join(part, MANIFEST_NAME))
            else:
                _write_as(part, manifest, os.path.join(part, MANIFEST_NAME))
            tier.hook("manifest")
            fsync_dir(part)
            tier.hook("fsync_dir")
            os.rename(part, final)
            tier.hook("rename")
            fsync_dir(tier.root)
            tier.hook("fsync_root")
    except OSError as exc:
        if not committed_here(tier, step, man.checkpoint_id):  # else another rank of this copy got there first
            if os.path.isdir(final):
                raise CheckpointExistsError(f"step {step} already exists in {tier.root!r} (pass overwrite=True "
                                            "or pick another step)") from None
            raise storage_error(f"committing step {step} in", tier.root, exc) from exc
    return tier.write_latest(step) if leader else ()


def _write_as(part: str, data: bytes, dst: str) -> None:
    """``data`` into ``dst`` durably: a temporary in ``part`` (removed on failure), fdatasync, rename."""
    with unlinked_on_error(os.path.join(part, f".manifest-{uuid.uuid4().hex[:8]}.tmp")) as tmp:
        write_file_durable(tmp, data)
        os.rename(tmp, dst)


def committed_here(tier: LocalTier, step: int, checkpoint_id: str) -> bool:
    """``step`` is committed in ``tier`` with ``checkpoint_id`` (False: absent, another, or unreadable)."""
    try:
        return tier.read_manifest(step).checkpoint_id == checkpoint_id
    except ZerostallError:
        return False
