"""Probe a checkpoint directory and pick the engine (``engine="auto"``).

Checks filesystem type, an O_DIRECT write of one block, ``statx`` STATX_DIOALIGN, and
io_uring availability (sysctl, liburing's C library, a ring actually set up). The verdict
is logged once per directory.
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import mmap
import os
import uuid
from dataclasses import dataclass
from functools import lru_cache

from ..config import ALIGN_BYTES
from . import _sys

log = logging.getLogger("zerostall")

_NO_DIRECT_FS = {"tmpfs", "ramfs", "overlay", "fuse", "9p", "virtiofs"}


@dataclass(frozen=True)
class ProbeResult:
    path: str
    fs_type: str
    mount_point: str
    o_direct: bool
    dio_mem_align: int | None
    dio_offset_align: int | None
    io_uring: bool
    io_uring_reason: str
    engine: str
    reason: str


def fs_of(path: str) -> tuple[str, str]:
    """(filesystem type, mount point) of ``path``: the mount with the longest matching prefix."""
    import psutil  # here: ``import zerostall`` does not load it

    real = os.path.realpath(path)
    try:
        parts = psutil.disk_partitions(all=True)
    except OSError:  # no readable mount table (a sandbox): an unknown filesystem, as before
        parts = []
    mounts = [m for m in parts if real == m.mountpoint or real.startswith(m.mountpoint.rstrip("/") + "/")]
    best = max(mounts, key=lambda m: len(m.mountpoint), default=None)
    return (best.fstype, best.mountpoint) if best is not None else ("unknown", "/")


def io_uring_status() -> tuple[bool, str]:
    try:
        with open("/proc/sys/kernel/io_uring_disabled") as f:
            disabled = int(f.read().strip() or 0)
    except (OSError, ValueError):
        disabled = 0
    if disabled == 2:
        return False, "kernel.io_uring_disabled=2"
    try:
        lib = _sys.liburing()
        init, done = lib.io_uring_queue_init, lib.io_uring_queue_exit
    except (ImportError, AttributeError) as exc:
        return False, f"{exc} (pip install 'zerostall[uring]')"
    ring = ctypes.create_string_buffer(4096)  # room for liburing's struct io_uring
    rc = init(2, ring, 0)
    if rc < 0:
        return False, f"io_uring_setup failed: {os.strerror(-rc)} (seccomp or sysctl)"
    done(ring)
    return True, "available" + (" (restricted to a group: kernel.io_uring_disabled=1)" if disabled == 1 else "")


def _try_direct(directory: str) -> tuple[bool, tuple[int, int] | None, str]:
    name = os.path.join(directory, f".zerostall-probe-{uuid.uuid4().hex[:8]}")
    try:
        fd = os.open(name, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_DIRECT | os.O_CLOEXEC, 0o600)
    except OSError as exc:
        return False, None, f"O_DIRECT open refused: {os.strerror(exc.errno or 0)}"
    try:
        with mmap.mmap(-1, ALIGN_BYTES) as buf:  # page-aligned, as O_DIRECT needs
            os.pwritev(fd, [buf], 0)
        return True, _sys.statx_dioalign(name), "O_DIRECT works"
    except OSError as exc:
        return False, None, f"O_DIRECT write refused: {os.strerror(exc.errno or 0)}"
    finally:
        os.close(fd)
        with contextlib.suppress(OSError):
            os.unlink(name)


@lru_cache(maxsize=64)
def probe(directory: str) -> ProbeResult:
    """Probe ``directory`` (must exist and be writable). Cached per path."""
    fs_type, mnt = fs_of(directory)
    direct, align, why = _try_direct(directory)
    mem_align, offset_align = align or (None, None)
    uring, uring_why = io_uring_status()
    if fs_type in _NO_DIRECT_FS or fs_type.startswith("fuse"):
        engine, reason = "buffered", f"{fs_type} has no device behind the page cache, O_DIRECT is meaningless"
    elif not direct:
        engine, reason = "buffered", why
    elif offset_align is not None and offset_align > ALIGN_BYTES:
        engine, reason = "buffered", f"O_DIRECT needs {offset_align}-byte alignment (> {ALIGN_BYTES})"
    elif uring:
        engine, reason = "uring", "O_DIRECT works and io_uring is available"
    else:
        engine, reason = "threads", f"O_DIRECT works; io_uring unavailable: {uring_why}"
    res = ProbeResult(os.path.realpath(directory), fs_type, mnt, direct, mem_align, offset_align,
                      uring, uring_why, engine, reason)
    log.info("zerostall: %s on %s (%s): engine %s: %s", directory, fs_type, mnt, engine, reason)
    return res
