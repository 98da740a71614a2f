"""crc32c of a buffer from the crc32c of its pieces (zlib's ``crc32_combine`` for the
Castagnoli polynomial, on 32x32 GF(2) matrices), so that pieces can be checksummed by several threads.
"""

from __future__ import annotations

import functools

_POLY = 0x82F63B78  # crc32c, reflected


def _times(mat: tuple[int, ...], vec: int) -> int:
    s, i = 0, 0
    while vec:
        if vec & 1:
            s ^= mat[i]
        vec >>= 1
        i += 1
    return s


def _mul(a: tuple[int, ...], b: tuple[int, ...]) -> tuple[int, ...]:
    return tuple(_times(a, col) for col in b)


@functools.lru_cache(maxsize=64)
def _shift(nbytes: int) -> tuple[int, ...]:
    """The operator appending ``nbytes`` zero bytes to an (unconditioned) crc register."""
    op = (_POLY,) + tuple(1 << (n - 1) for n in range(1, 32))  # one zero bit
    for _ in range(3):
        op = _mul(op, op)  # then one zero byte
    out = tuple(1 << n for n in range(32))  # the identity
    while nbytes:
        if nbytes & 1:
            out = _mul(op, out)
        nbytes >>= 1
        op = _mul(op, op)
    return out


def combine(crc_a: int, crc_b: int, len_b: int) -> int:
    """crc32c(a + b) from crc32c(a), crc32c(b) and len(b)."""
    if len_b == 0:
        return crc_a
    return _times(_shift(len_b), crc_a) ^ crc_b
