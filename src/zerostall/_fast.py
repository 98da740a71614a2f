"""The speed tricks, each behind a name, each beside a plain twin that gives the same result.

Every name here is a shortcut around a per-item cost of CPython, ctypes or torch;
``docs/speed-tricks.md`` says what each saves, and ``tests/api/test_fast.py`` checks each
against its twin. The core calls these names, never the tricks themselves. Any thread. Imports
no torch (the CLI's ``ls``/``inspect`` run without it): the tricks on tensors are in
:mod:`._fast_torch`.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import dataclasses
import json
import operator
import re
import secrets
from functools import partial
from typing import Any, Callable, Iterable, Iterator, Sequence, TypeVar

from crc32c import crc32c as _crc32c

R = TypeVar("R")

# -- records ------------------------------------------------------------------------------


def tuple_maker(cls: type[R]) -> Callable[[Iterable[Any]], R]:
    """``make(row)``: the named tuple ``cls`` holding ``row`` (its fields in order), made at C
    level (no Python frame, no length check: the caller's rows have the right length). Twin:
    ``cls(*row)``."""
    return partial(tuple.__new__, cls)  # type: ignore[return-value]


def tuples_maker(cls: type[R]) -> Callable[[Iterable[Iterable[Any]]], Iterator[R]]:
    """``make(rows)``: a lazy ``map`` of :func:`tuple_maker` over ``rows``."""
    return partial(map, tuple_maker(cls))  # type: ignore[return-value]


def frozen_maker(cls: type[R]) -> Callable[..., R]:
    """``make(**fields)``: the frozen dataclass ``cls`` without its ``__init__``'s
    ``object.__setattr__`` per field (fields not given take their defaults; no
    ``__post_init__`` runs, nothing is checked). Twin: ``cls(**fields)``."""
    new = object.__new__
    defaults = {f.name: f.default for f in dataclasses.fields(cls) if f.default is not dataclasses.MISSING}

    def make(**fields: Any) -> R:
        obj = new(cls)
        obj.__dict__.update(defaults, **fields)
        return obj
    return make


# -- column getters: ``map(OFFSET, items)`` reads one attribute per item at C level (twin: getattr)
KEY, TENSOR, NUMPY, DTYPE, DEVICE, SHAPE = map(operator.attrgetter, ("key", "tensor", "numpy", "dtype", "device",
                                                                    "shape"))
FILE, OFFSET, NBYTES, CRC32C, INDEX = map(operator.attrgetter, ("file", "offset", "nbytes", "crc32c", "index"))
TYPE, LAYOUT, IS_NESTED = map(operator.attrgetter, ("type", "layout", "is_nested"))
SECOND = operator.itemgetter(1)


# -- libc: one handle, every prototype declared once -----------------------------------------
libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
"""The C library, for the calls ``os`` lacks; each call's prototype is declared below, here only."""
_VP, _SZ, _INT = ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int
for _name, _args, _res in (
        ("fallocate64", [_INT, _INT, ctypes.c_int64, ctypes.c_int64], _INT),
        ("sync_file_range", [_INT, ctypes.c_int64, ctypes.c_int64, ctypes.c_uint], _INT),
        ("mmap", [_VP, _SZ, _INT, _INT, _INT, ctypes.c_long], _VP),
        ("mlock", [_VP, _SZ], _INT),
        ("munlock", [_VP, _SZ], _INT),
        ("madvise", [_VP, _SZ, _INT], _INT),
        ("renameat2", [_INT, ctypes.c_char_p, _INT, ctypes.c_char_p, ctypes.c_uint], _INT)):
    _fn = getattr(libc, _name, None)  # renameat2: glibc >= 2.28 only
    if _fn is not None:
        _fn.argtypes, _fn.restype = _args, _res

_held = ctypes.PyDLL(None)
memmove_held, memset_held = _held.memmove, _held.memset
"""``memmove(dst, src, n)``/``memset(dst, byte, n)`` that keep the GIL (``ctypes.memmove``
releases and retakes it per call): for runs of small copies, each run short enough (a block)
to stay under the interpreter's switch interval. Twins: ``ctypes.memmove``/``ctypes.memset``."""
memmove_held.argtypes, memmove_held.restype = [_VP, _VP, _SZ], _VP
memset_held.argtypes, memset_held.restype = [_VP, _INT, _SZ], _VP


def copy_runs(dsts: Iterable[int], srcs: Iterable[int], lens: Iterable[int]) -> None:
    """``memmove`` of each (dst, src, n), the GIL held throughout (one C-level map)."""
    list(map(memmove_held, dsts, srcs, lens))


def zero_runs(dsts: Iterable[int], lens: Iterable[int]) -> None:
    """``memset(dst, 0, n)`` of each (dst, n), the GIL held throughout."""
    dsts = list(dsts)
    list(map(memset_held, dsts, [0] * len(dsts), lens))


# -- one pass: copy and checksum while the bytes are in the cache ------------------------------
CRC_PIECE_BYTES = 512 << 10
"""Copied, then checksummed, piece by piece: small enough to stay in a core's cache between the
two (1 MiB of L2 per core where this was measured)."""


def copy_crc(dst: int, src: int, n: int, dst_mv: memoryview, doff: int, crc: int = 0) -> int:
    """Copy ``n`` bytes from address ``src`` to ``dst`` (``dst_mv[doff:]`` views ``dst``) and return
    ``crc`` extended over them, piece by piece while each piece is still in the cache: one pass
    over memory instead of a copy and a second read. ``ctypes.memmove`` and ``crc32c`` release the
    GIL. Twin: :func:`copy_then_crc`."""
    for p in range(0, n, CRC_PIECE_BYTES):
        k = min(CRC_PIECE_BYTES, n - p)
        ctypes.memmove(dst + p, src + p, k)
        crc = _crc32c(dst_mv[doff + p:doff + p + k], crc)
    return crc


def copy_then_crc(dst: int, src: int, n: int, dst_mv: memoryview, doff: int, crc: int = 0) -> int:
    """The twin of :func:`copy_crc`: one copy, then one checksum of the copy."""
    ctypes.memmove(dst, src, n)
    return _crc32c(dst_mv[doff:doff + n], crc)


def crc_runs(mv: memoryview, starts: Sequence[int], ends: Sequence[int]) -> list[int]:
    """crc32c of each ``mv[start:end]`` (a run of small items just copied) by C-level maps, no
    Python frame per item. Twin: :func:`plain_crc_runs`."""
    return list(map(_crc32c, map(mv.__getitem__, map(slice, starts, ends))))


def plain_crc_runs(mv: memoryview, starts: Sequence[int], ends: Sequence[int]) -> list[int]:
    """The twin of :func:`crc_runs`: one ``crc32c`` call per item."""
    return [_crc32c(mv[a:b]) for a, b in zip(starts, ends)]


# -- JSON with already-encoded pieces spliced in ----------------------------------------------
_NONCE = secrets.token_hex(8)


class Splice:
    """One marker-and-splice scheme for JSON: a value that must become already-encoded JSON
    text is written as a marker string (:meth:`mark`, ``json.dumps`` escapes its NULs), and
    :meth:`splice` swaps every marker for its piece in one pass. ``tag`` keeps two users'
    markers apart. The twin: ``json.dumps`` of the object with each piece decoded in place.
    """

    def __init__(self, tag: str):
        self.prefix = f"\x00zs{tag}{_NONCE}:"
        self._re = re.compile(re.escape(json.dumps(self.prefix)[:-1]) + r"([0-9]+)\\u0000\"")

    def mark(self, i: int) -> str:
        """The marker of piece ``i`` (a str to put where the piece goes)."""
        return f"{self.prefix}{i}\x00"

    def splice(self, text: str, pieces: Sequence[str]) -> str:
        """``text`` (JSON holding markers) with marker ``i`` replaced by ``pieces[i]``."""
        return self._re.sub(lambda m: pieces[int(m.group(1))], text)
