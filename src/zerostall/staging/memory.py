"""Host memory facts and the one GIL-free fault call the staging arena uses.

``budget_bytes`` (the Checkpointer's staging budget, ``doctor``), ``host_ram_bytes`` and
``local_world_size`` (any thread); ``populate`` (the arena's faulter thread, or the caller's
for a small scratch arena): ctypes releases the GIL around the ``madvise``.
"""

from __future__ import annotations

import ctypes
import logging
import mmap
import os

log = logging.getLogger("zerostall")

MADV_POPULATE_WRITE = getattr(mmap, "MADV_POPULATE_WRITE", 23)

_libc = ctypes.CDLL(None, use_errno=True)
_libc.mlock.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
_libc.munlock.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
_libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
_libc.mmap.restype = ctypes.c_void_p
_libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
_populate_ok = True  # cleared once if the kernel lacks MADV_POPULATE_WRITE (< 5.14)


def host_ram_bytes() -> int:
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def local_world_size() -> int:
    try:
        return max(1, int(os.environ.get("LOCAL_WORLD_SIZE", "1")))
    except ValueError:
        return 1


def budget_bytes(budget: int | None, fraction: float) -> int:
    """The staging budget of this process: explicit bytes, else a fraction of RAM per local rank."""
    if budget is not None:
        return budget
    return int(host_ram_bytes() * fraction) // local_world_size()


def populate(address: int, nbytes: int) -> None:
    """Fault ``nbytes`` at ``address`` for writing, without holding the GIL (ctypes releases it)."""
    global _populate_ok
    if _populate_ok:
        if _libc.madvise(ctypes.c_void_p(address), nbytes, MADV_POPULATE_WRITE) == 0:
            return
        if ctypes.get_errno() != 22:  # EINVAL: kernel < 5.14; anything else: touch instead
            log.debug("zerostall: MADV_POPULATE_WRITE failed: %s", os.strerror(ctypes.get_errno()))
        else:
            _populate_ok = False
    ctypes.memset(address, 0, nbytes)
