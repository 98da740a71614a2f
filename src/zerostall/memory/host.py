"""Host memory facts (the staging budget, any thread) and the GIL-free fault calls of the
staging arena (:mod:`.arena`), plus the placeholders a forked child gets for its arenas.
"""

from __future__ import annotations

import ctypes
import logging
import mmap
import os
import weakref
from typing import Any

from .._fast import libc as _libc

log = logging.getLogger("zerostall")

MADV_POPULATE_WRITE = getattr(mmap, "MADV_POPULATE_WRITE", 23)
MADV_HUGEPAGE, MADV_NOHUGEPAGE = getattr(mmap, "MADV_HUGEPAGE", 14), getattr(mmap, "MADV_NOHUGEPAGE", 15)

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


_unforked: "weakref.WeakSet[Any]" = weakref.WeakSet()
"""Live arenas made with ``dontfork=True`` (their address ranges are holes in a forked child)."""


def _fill_holes_in_child() -> None:
    """After fork, in the child: an anonymous placeholder where each ``dontfork`` arena was, so
    no later mapping lands in the range the stale ``mmap`` object unmaps when collected."""
    prot = mmap.PROT_READ | mmap.PROT_WRITE
    flags = (mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | 0x10  # MAP_FIXED
             | getattr(mmap, "MAP_NORESERVE", 0))
    for a in list(_unforked):
        if a.closed:
            continue
        _libc.mmap(ctypes.c_void_p(a.address), a.nbytes, prot, flags, -1, 0)
        a._cuda_chunks.clear()
        a.cuda_registered = False
        a.locked = False
        a.forked_copy = True


os.register_at_fork(after_in_child=_fill_holes_in_child)
