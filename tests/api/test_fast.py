"""Each speed trick of zerostall._fast against its plain twin: the same values, the same bytes."""

from __future__ import annotations

import ctypes
import json
import mmap
import os
import types
from dataclasses import dataclass
from typing import NamedTuple

import crc32c
import torch

from zerostall import _fast, _fast_torch


class Row(NamedTuple):
    key: str
    n: int
    flag: bool = False


@dataclass(frozen=True)
class Rec:
    key: str
    offset: int
    nbytes: int


def test_tuple_makers_equal_the_constructor():
    rows = [("a", 1, True), ("b", 2, False)]
    fast, plain = list(map(_fast.tuple_maker(Row), rows)), [Row(*row) for row in rows]
    assert fast == plain and all(type(r) is Row for r in fast)
    assert list(_fast.tuples_maker(Row)(rows)) == plain
    assert fast[0].flag is True and fast[1].n == 2


def test_frozen_maker_equals_the_constructor():
    made = _fast.frozen_maker(Rec)(key="k", offset=4096, nbytes=7)
    assert made == Rec("k", 4096, 7) and hash(made) == hash(Rec("k", 4096, 7)) and type(made) is Rec


def test_getters_read_the_attribute():
    names = ("key", "tensor", "numpy", "dtype", "device", "shape", "file", "offset", "nbytes", "crc32c", "index",
             "type", "layout", "is_nested")
    obj = types.SimpleNamespace(**{name: object() for name in names})
    for name in names:
        assert getattr(_fast, name.upper())(obj) is getattr(obj, name), name
    assert _fast.SECOND(("a", "b")) == "b"


def test_shape_of_equals_the_shape():
    for t in (torch.zeros(()), torch.zeros(3, 0, 5), torch.zeros(4, 6)[:, ::2], torch.zeros(2, 3).t()):
        assert _fast_torch.shape_of(t) == _fast_torch.plain_shape_of(t) == tuple(t.shape)
        assert type(_fast_torch.shape_of(t)) is tuple and all(type(d) is int for d in _fast_torch.shape_of(t))


def test_held_copies_write_what_memmove_writes():
    src = bytes(range(256)) * 64
    a, b = mmap.mmap(-1, len(src) * 2), mmap.mmap(-1, len(src) * 2)
    for m in (a, b):
        m[:] = b"\xff" * len(m)
    addr = [ctypes.addressof(ctypes.c_char.from_buffer(m)) for m in (a, b)]
    keep = ctypes.create_string_buffer(src, len(src))
    s = ctypes.addressof(keep)
    runs = [(0, 0, 100), (4096, 300, 5000), (10000, 16000, 383)]
    _fast.copy_runs([addr[0] + d for d, _, _ in runs], [s + o for _, o, _ in runs], [n for _, _, n in runs])
    for d, o, n in runs:
        ctypes.memmove(addr[1] + d, s + o, n)
    _fast.zero_runs([addr[0] + 200, addr[0] + 20000], [50, 7])
    ctypes.memset(addr[1] + 200, 0, 50)
    ctypes.memset(addr[1] + 20000, 0, 7)
    assert a[:] == b[:] and a[4096:4096 + 5000] == src[300:5300] and a[200:250] == b"\0" * 50


def test_one_libc_handle_with_its_prototypes():
    assert _fast.libc.madvise.argtypes and _fast.libc.mmap.restype is ctypes.c_void_p
    assert _fast.libc.getpid() > 0


def test_splice_equals_encoding_the_pieces_in_place():
    sp, other = _fast.Splice("t"), _fast.Splice("u")
    pieces = ['[1,2,{"a":"\\u0000"}]', '{"x":null}']
    obj = {"k": sp.mark(0), "l": [sp.mark(1), other.mark(0), "\x00zs plain"], "s": "\u00e9\x00"}
    text = sp.splice(json.dumps(obj, separators=(",", ":")), pieces)
    want = dict(obj, k=json.loads(pieces[0]), l=[json.loads(pieces[1]), other.mark(0), "\x00zs plain"])
    assert text == json.dumps(want, separators=(",", ":"))
    assert other.splice(text, ["7"]) == json.dumps(dict(want, l=[want["l"][0], 7, "\x00zs plain"]),
                                                   separators=(",", ":"))


def test_copy_crc_equals_its_plain_twin():
    n = 3 * _fast.CRC_PIECE_BYTES + 12345
    src = bytearray(os.urandom(n))
    out = []
    for fn in (_fast.copy_crc, _fast.copy_then_crc):
        dst = bytearray(n + 64)
        addr = ctypes.addressof((ctypes.c_char * len(dst)).from_buffer(dst))
        s_addr = ctypes.addressof((ctypes.c_char * n).from_buffer(src))
        crc = fn(addr + 64, s_addr, n, memoryview(dst), 64, crc32c.crc32c(b"seed"))
        out.append((bytes(dst), crc))
    assert out[0] == out[1] and out[0][0][64:] == bytes(src)
    assert out[0][1] == crc32c.crc32c(bytes(src), crc32c.crc32c(b"seed"))
    mv = memoryview(bytes(src))
    runs = ([0, 100, 100], [100, 5000, 100])
    assert _fast.crc_runs(mv, *runs) == _fast.plain_crc_runs(mv, *runs) == [
        crc32c.crc32c(src[:100]), crc32c.crc32c(src[100:5000]), 0]
