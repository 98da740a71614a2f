"""Start-up recovery of a local root by its new owner: finish or remove what a crash left.

Called once by :meth:`.local.LocalTier.own` (root lock held): ``step-N.old`` is finished or
rolled back (:func:`.atomic.recover_dir`); a ``step-N.partial`` holding ``manifest.decided``
(:mod:`zerostall.distributed.finish`) is completed; any other ``step-N.partial``,
``.deleting-*``, temporary files and stale restore locks are removed, except for a step whose
:class:`~.owner.StepLock` a restore holds.
"""

from __future__ import annotations

import logging
import os
import re
from typing import TYPE_CHECKING

from ..errors import ZerostallError, storage_error
from ..format.manifest import MANIFEST_NAME
from .atomic import fsync_dir, recover_dir, rmtree
from .owner import FETCH_STEP_LOCK_RE, StepLock

if TYPE_CHECKING:
    from .local import LocalTier

log = logging.getLogger("zerostall")

DECIDED_NAME = "manifest.decided"
"""In ``step-N.partial/``: the manifest the ranks' commit decision committed, recorded by the
copy before any rank's handle says durable; its presence makes the partial a committed step."""

_PARTIAL_RE = re.compile(r"^step-(\d{1,19})\.partial$")
_OLD_RE = re.compile(r"^step-(\d{1,19})\.old$")
_FETCH_LOCK_RE = re.compile(FETCH_STEP_LOCK_RE)
_DELETING_STEP_RE = re.compile(r"^\.deleting-step-(\d{1,19})(?:\.old)?-")
_TEMP_RE = re.compile(r"^(latest\.tmp|\.zerostall-write-test-\d+|\.zerostall-probe-[0-9a-f]+)$")


def recover_root(tier: "LocalTier") -> list[str]:
    """The actions taken on ``tier``'s root (each logged)."""
    root, names, step_dir, hook = tier.root, tier._names, tier.step_dir, tier.hook

    def valid_dir(d: str, step: int) -> bool:
        try:
            tier._read_manifest_at(d, step)
            return True
        except ZerostallError:
            return False

    done: list[str] = []
    locks: dict[int, StepLock] = {}
    busy: set[int] = set()

    def free(m: re.Match[str] | None) -> bool:
        """Whether the leftovers of the step ``m`` names (None: of no step) are ours to clean (its
        StepLock taken without waiting)."""
        step = int(m.group(1)) if m else None
        if step is None or step in locks:
            return True
        if step in busy:
            return False
        lk = StepLock(root, step)
        if os.path.lexists(lk.path) and not os.path.isfile(lk.path) or os.path.islink(lk.path):
            # a directory, FIFO or link under a lock file's name: no process can hold it
            # (StepLock refuses anything but a regular file), so it is a leftover like the rest
            rmtree(lk.path)  # never follows a link
            done.append(f"removed {lk.path} (not a lock file)")
        if lk.acquire(wait=False):
            locks[step] = lk
            return True
        busy.add(step)
        done.append(f"kept the leftovers of step {step}: {lk.holder()} is downloading it into {root}")
        return False

    try:
        for n in sorted(names()):
            if (m := _OLD_RE.match(n)) and free(m):
                step = int(m.group(1))
                done += recover_dir(step_dir(step), lambda d, s=step: valid_dir(d, s), hook)
        for n in sorted(names()):
            path = os.path.join(root, n)
            if (m := _PARTIAL_RE.match(n)) and free(m):
                if _complete_decided(tier, path, step_dir(int(m.group(1))), int(m.group(1))):
                    done.append(f"completed step {m.group(1)} in {root} (committed by the ranks' decision; a crash "
                                "interrupted its rename)")
                    continue
                rmtree(path)
                done.append(f"removed {path} (an unfinished save)")
            elif n.startswith(".deleting-") and free(_DELETING_STEP_RE.match(n)):
                rmtree(path)
                done.append(f"removed {path} (an interrupted deletion)")
            elif _TEMP_RE.match(n):
                rmtree(path)
                done.append(f"removed {path} (a temporary file)")
            elif (m := _FETCH_LOCK_RE.match(n)) and free(m):
                done.append(f"removed {path} (the lock of an interrupted restore)")
    except OSError as exc:
        raise storage_error("recovering leftovers in", root, exc) from exc
    finally:
        for lk in locks.values():
            lk.release(unlink=True)
    for line in done:
        log.info("zerostall: %s", line)
    return done


def _complete_decided(tier: "LocalTier", part: str, final: str, step: int) -> bool:
    """Rename ``part`` into ``final`` if it holds a decision record of ``step`` (and ``final``
    does not exist); False: not a decided step, the caller removes it."""
    rec = os.path.join(part, DECIDED_NAME)
    if os.path.lexists(final) or not os.path.lexists(rec):
        return False
    try:
        tier._read_manifest_at(part, step, DECIDED_NAME)
    except (OSError, ZerostallError) as exc:
        log.warning("zerostall: %s is not a readable decision record (%s); the partial step is removed", rec, exc)
        return False
    os.rename(rec, os.path.join(part, MANIFEST_NAME))
    fsync_dir(part)
    os.rename(part, final)
    fsync_dir(tier.root)
    return True
