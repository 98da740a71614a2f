"""One pass over a tensor's bytes: copy them into the staging arena and checksum them there
while they are still in the cache, instead of a second pass over memory by the persist thread.

:func:`copy_crc` is the fast one, :func:`copy_then_crc` its plain twin (copy everything, then
checksum the copy); both leave the same bytes in the arena and return the same crc32c (a test
says so). Called from the snapshot thread (and its short-lived strided-copy helper) for saves
whose tensors are all in host memory; the persist thread then writes without a crc pass of its
own (``Job.crc_at_copy``). Neither holds the GIL during the copy or the checksum (``ctypes.memmove``
and ``crc32c`` release it).
"""

from __future__ import annotations

import ctypes

import crc32c as _crc

PIECE_BYTES = 512 << 10
"""Copied, then checksummed, piece by piece: small enough to stay in a core's cache between the
two (measured here: 1 MiB of L2 per core, 32 MiB of shared L3)."""
ENABLED = True
"""Whether saves of host tensors checksum at copy time (the seam tests flip to compare)."""

_memmove = ctypes.memmove


def copy_crc(dst: int, src: int, n: int, arena_mv: memoryview, aoff: int, crc: int = 0) -> int:
    """Copy ``n`` bytes from address ``src`` to ``dst`` (``arena_mv[aoff:]`` views ``dst``) and
    return ``crc`` extended over them, piece by piece while each piece is in the cache."""
    for p in range(0, n, PIECE_BYTES):
        k = min(PIECE_BYTES, n - p)
        _memmove(dst + p, src + p, k)
        crc = _crc.crc32c(arena_mv[aoff + p:aoff + p + k], crc)
    return crc


def copy_then_crc(dst: int, src: int, n: int, arena_mv: memoryview, aoff: int, crc: int = 0) -> int:
    """The plain twin of :func:`copy_crc`: one copy, then one checksum of the copy."""
    _memmove(dst, src, n)
    return _crc.crc32c(arena_mv[aoff:aoff + n], crc)


def crc_runs(arena_mv: memoryview, starts: list[int], ends: list[int]) -> list[int]:
    """crc32c of each ``arena_mv[start:end]`` (a run of small items just copied; C-level maps,
    no Python frame per item)."""
    return list(map(_crc.crc32c, map(arena_mv.__getitem__, map(slice, starts, ends))))
