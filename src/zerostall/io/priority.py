"""The I/O class of background threads: the uploader and the peer replication threads call
:func:`set_idle_io_priority` on themselves, so their disk I/O takes only what the training
leaves over. Never called on the caller's, snapshot or persist threads."""

from __future__ import annotations

import logging
import threading

log = logging.getLogger("zerostall")


def set_idle_io_priority() -> bool:
    """IOPRIO_CLASS_IDLE for the calling thread (and the threads it creates later), through
    psutil (no per-architecture syscall numbers here). False where the OS refuses."""
    try:
        import psutil
        psutil.Process(threading.get_native_id()).ionice(psutil.IOPRIO_CLASS_IDLE)
        return True
    except Exception as exc:  # noqa: BLE001 - best effort: non-Linux, seccomp, old psutil
        log.debug("zerostall: cannot set idle I/O priority for the replicator: %s", exc)
        return False
