"""io_uring's registered ("fixed") buffers, for the ``uring`` engine (:mod:`.uring`).

A region registered with a ring is pinned by the kernel once; a write from it then names the
region (``io_uring_prep_write_fixed``) and the kernel skips pinning its pages again, which for an
O_DIRECT write of a 4 KiB-page buffer is a page-table walk per page. The binding's shared library
may not export these calls: :func:`load_fixed` says whether it does. Loaded once at import.
"""

from __future__ import annotations

import ctypes

FIXED_PIECE_BYTES = 1 << 30
"""The kernel's largest registered buffer: a longer region is registered in pieces of this size."""

_SIG = {"io_uring_register_buffers": (ctypes.c_int, [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_uint]),
        "io_uring_unregister_buffers": (ctypes.c_int, [ctypes.c_void_p]),
        "io_uring_prep_write_fixed": (None, [ctypes.c_void_p, ctypes.c_int, ctypes.c_void_p, ctypes.c_uint,
                                             ctypes.c_uint64, ctypes.c_int])}


class PieceIovec(ctypes.Structure):
    """``struct iovec``: one registered piece."""

    _fields_ = [("base", ctypes.c_void_p), ("len", ctypes.c_size_t)]


def load_fixed(lib: ctypes.CDLL | None) -> bool:
    """Give ``lib``'s registered-buffer calls their prototypes; whether it exports them all."""
    if lib is None:
        return False
    try:
        for name, (res, args) in _SIG.items():
            fn = getattr(lib, name)
            fn.restype, fn.argtypes = res, args
    except AttributeError:
        return False
    return True
