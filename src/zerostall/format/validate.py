"""The one validation pass over untrusted checkpoint metadata, before any allocation or read.

Called by :meth:`Manifest.from_bytes` (any thread) on every manifest read from a tier, and
by the tiers for directory entries and file opens. Every defect becomes
:class:`CorruptCheckpoint` naming the file and the field; nothing here allocates more than the
metadata itself, follows a symlink, blocks on a FIFO or executes anything. Checked: finite
JSON numbers, int fields in range, bounded shapes (``shape x itemsize == nbytes``), entries
inside their files, aligned and disjoint but for exact duplicates (aliases, read once), and
canonical step directory names; the state tree by :func:`.decode.decode_tree`.
"""

from __future__ import annotations

import json
import logging
import math
import os
import re
import stat
from dataclasses import dataclass
from typing import Any, Sequence

from ..config import ALIGN_BYTES
from ..errors import CorruptCheckpoint
from .layout import (FILE_NAME_RE, HEADER_BYTES, ITEM_ALIGN, LINE_ITEM_BYTES, PAGE_ITEM_BYTES, SMALL_ALIGN,
                     item_align, item_end)
from .._fast import FILE, INDEX, NBYTES, OFFSET

log = logging.getLogger("zerostall")

MAX_STEP = (1 << 63) - 1
MAX_DIM = 1 << 62
MAX_NDIM = 64
MAX_ELEMENTS = 1 << 62
MAX_KEY_CHARS = 1 << 16
MAX_DEPTH = 200
"""Deepest nesting of a state tree that is saved or loaded."""
MAX_INT_BITS = 4096
"""Plain ints in a state are bounded: far below the digit limit of int<->str, so what is saved parses."""

ITEMSIZE_BY_NAME: dict[str, int] = {
    "float64": 8, "float32": 4, "float16": 2, "bfloat16": 2, "complex64": 8, "complex128": 16,
    "int64": 8, "int32": 4, "int16": 2, "int8": 1, "uint8": 1, "uint16": 2, "uint32": 4, "uint64": 8, "bool": 1,
    "float8_e4m3fn": 1, "float8_e4m3fnuz": 1, "float8_e5m2": 1, "float8_e5m2fnuz": 1, "float8_e8m0fnu": 1,
}
"""The tensor dtype names the format stores and their element sizes. Any other name is
corruption, never a ``getattr(torch, name)`` (:mod:`.dtypes` maps them to torch dtypes)."""

NUMPY_DTYPES = frozenset(n for n in ITEMSIZE_BY_NAME if n != "bfloat16" and not n.startswith("float8"))
"""Tensor dtypes that have a numpy equivalent (a numpy node over bfloat16 is corruption)."""

_STEP_DIR_RE = re.compile(r"^step-(\d{1,19})$")
_warned_names: set[str] = set()


def bad(where: str, msg: str, key: str | None = None) -> CorruptCheckpoint:
    return CorruptCheckpoint(f"{where}: {msg}", path=where, key=key)


def unknown_dtype(name: object, where: str = "manifest") -> CorruptCheckpoint:
    """The error for a dtype name the format does not define."""
    return bad(where, f"unknown dtype {name!r}")


# -- JSON ------------------------------------------------------------------------------------
def _parse_float(s: str) -> float:
    v = float(s)
    if not math.isfinite(v):
        raise ValueError(f"number {s[:40]} is out of range (not a finite float)")
    return v


def _parse_constant(name: str) -> Any:
    raise ValueError(f"non-standard JSON constant {name}")


def loads(raw: bytes | str, where: str) -> Any:
    """``json.loads`` that rejects NaN/Infinity and numbers that overflow to inf."""
    try:
        return json.loads(raw, parse_float=_parse_float, parse_constant=_parse_constant)
    except (ValueError, RecursionError, UnicodeDecodeError) as exc:
        raise bad(where, f"not valid JSON ({str(exc)[:160]})") from None


def integer(obj: dict[str, Any], k: str, where: str, lo: int = 0, hi: int = MAX_DIM, ctx: str = "") -> int:
    v = obj.get(k)
    if type(v) is not int or not lo <= v <= hi:
        raise bad(where, f"{ctx}field {k!r} = {v!r:.60} is not an integer in [{lo}, {hi}]")
    return v


def file_fields(f: Any, where: str, ctx: str, max_rank: int) -> tuple[str, int, int, str, str]:
    """(name, rank, file_bytes, file_id, host) of one object of a manifest's ``files`` or
    ``ref_files`` (``ctx`` starts each error): a plain name, a whole number of pages."""
    if not isinstance(f, dict):
        raise bad(where, f"{ctx}file entry is not an object")
    name = f.get("name")
    if not isinstance(name, str) or not FILE_NAME_RE.match(name) or name == "manifest.json":
        raise bad(where, f"{ctx}file name {name!r:.80} is not a plain file name inside the checkpoint")
    ctx += f"file {name!r}: "
    fb = integer(f, "file_bytes", where, 0, MAX_DIM, ctx)
    if fb % ALIGN_BYTES or fb < HEADER_BYTES:
        raise bad(where, f"{ctx}file_bytes {fb} is not a multiple of {ALIGN_BYTES} of at least {HEADER_BYTES}")
    for k, most in (("file_id", 64), ("host", 255)):
        if not isinstance(f.get(k, ""), str) or len(f.get(k, "")) > most:
            raise bad(where, f"{ctx}bad {k} {f[k]!r:.80}")
    return name, integer(f, "rank", where, 0, max_rank, ctx), fb, f.get("file_id", ""), f.get("host", "")


# -- shapes and entries ----------------------------------------------------------------------
def check_shape(shape: Any, itemsize: int, nbytes: int, where: str, key: str) -> tuple[int, ...]:
    """A shape whose element count (with every dim, even when one is 0) stays bounded.
    0-d and 1-d shapes take one inline check (one call per entry of a manifest)."""
    if type(shape) is list:
        if not shape and nbytes == itemsize:
            return ()
        if len(shape) == 1 and type(shape[0]) is int and 0 <= shape[0] < MAX_DIM and shape[0] * itemsize == nbytes:
            return (shape[0],)
    if not isinstance(shape, list) or len(shape) > MAX_NDIM:
        raise bad(where, f"tensor {key!r}: bad shape {shape!r:.80}", key)
    bound = 1
    for d in shape:
        if type(d) is not int or not 0 <= d < MAX_DIM:
            raise bad(where, f"tensor {key!r}: bad dimension {d!r:.40} in shape", key)
        bound *= max(d, 1)
        if bound > MAX_ELEMENTS:
            raise bad(where, f"tensor {key!r}: shape {shape!r:.80} has more than 2**62 elements "
                             "(even if one dimension is 0)", key)
    if math.prod(shape) * itemsize != nbytes:
        raise bad(where, f"tensor {key!r}: shape {shape!r:.80} x {itemsize} bytes is not {nbytes} bytes", key)
    return tuple(shape)


@dataclass(frozen=True)
class Span:
    index: int
    file: str
    offset: int
    nbytes: int
    ident: tuple[Any, ...]
    key: str


def check_spans(spans: Sequence[Span] | Any, file_bytes: dict[str, int], where: str) -> dict[int, int]:
    """``spans`` (a list, or :class:`.table.EntrySpans`) inside their files, aligned and disjoint;
    returns ``{index: index of the first identical entry}`` for the exact duplicates (aliases)."""
    if len(spans) >= _BULK_SPANS and _disjoint_in_bulk(spans, file_bytes):  # type: ignore[arg-type]
        return {}  # the common case, checked in bulk; anything else takes the loop (exact messages)
    alias: dict[int, int] = {}
    by_file: dict[str, list[Span]] = {}
    for s in spans:
        fb = file_bytes.get(s.file)
        if fb is None:
            raise bad(where, f"tensor {s.key!r}: file {s.file!r:.80} is not listed in 'files'", s.key)
        if s.offset % item_align(s.nbytes) or s.offset < ALIGN_BYTES or s.offset + s.nbytes > fb:
            raise bad(where, f"tensor {s.key!r}: offset {s.offset} + {s.nbytes} bytes lies outside "
                             f"{s.file!r} ({fb} bytes) or is unaligned", s.key)
        by_file.setdefault(s.file, []).append(s)
    for f, lst in by_file.items():
        lst.sort(key=lambda s: (s.offset, -s.nbytes, s.index))
        prev: Span | None = None
        for s in lst:
            if s.nbytes == 0:
                continue
            if prev is not None and s.offset < item_end(prev.offset, prev.nbytes):
                if (s.offset, s.nbytes, s.ident) == (prev.offset, prev.nbytes, prev.ident):
                    alias[s.index] = alias.get(prev.index, prev.index)
                    continue
                raise bad(where, f"tensor {s.key!r} overlaps tensor {prev.key!r} in {f!r} "
                                 f"(offset {s.offset} < {prev.offset} + {prev.nbytes})", s.key)
            prev = s
    return alias


_BULK_SPANS = 1024


def _disjoint_in_bulk(spans: Any, file_bytes: dict[str, int]) -> bool:
    """True if :func:`check_spans` has nothing to report (one file, numpy over all spans at once);
    False otherwise, and the loop finds what and says it."""
    import numpy as np  # here, not at the top: a small manifest (zerostall ls/inspect) needs none
    n = len(spans)
    cols = spans.columns() if hasattr(spans, "columns") else (  # parsed columns (format.table), or Spans
        list(map(FILE, spans)), map(OFFSET, spans), map(NBYTES, spans), map(INDEX, spans))
    names, offs, nbs, idx = cols
    if len(set(names)) != 1:
        return False  # several files: the loop (per-file order)
    fb = file_bytes.get(names[0])  # None: not listed
    if type(fb) is not int or not 0 <= fb < 1 << 61:  # offset + size stays inside int64
        return False
    try:
        off = np.fromiter(offs, np.int64, n)
        nb = np.fromiter(nbs, np.int64, n)
    except (OverflowError, TypeError, ValueError):
        return False
    if off.min() < ALIGN_BYTES or nb.min() < 0 or off.max() > fb or nb.max() > fb or (off + nb > fb).any():
        return False
    # layout.item_align in bulk
    small = np.minimum(SMALL_ALIGN, 1 << np.ceil(np.log2(np.maximum(nb, 1))).astype(np.int64))
    align = np.where(nb >= PAGE_ITEM_BYTES, ALIGN_BYTES, np.where(nb >= LINE_ITEM_BYTES, ITEM_ALIGN, small))
    if (off % align).any():
        return False
    order = np.lexsort((np.fromiter(idx, np.int64, n), -nb, off))
    o, n = off[order], nb[order]
    keep = n > 0
    o, n = o[keep], n[keep]
    end = o + n
    page = n >= PAGE_ITEM_BYTES
    end[page] = (end[page] + ALIGN_BYTES - 1) // ALIGN_BYTES * ALIGN_BYTES  # layout.item_end
    return bool((o[1:] >= end[:-1]).all())


# -- directory entries and files -------------------------------------------------------------
def parse_step_dir(name: str, root: str = "") -> int | None:
    """The step of a canonical step directory name (``step-<N>``, no leading zeros, N < 2**63),
    or None; a look-alike (``step-03``) is ignored with a warning, once per name."""
    m = _STEP_DIR_RE.match(name)
    if not m:
        return None
    digits = m.group(1)
    step = int(digits)
    if str(step) != digits or step > MAX_STEP:
        full = os.path.join(root, name)
        if full not in _warned_names:
            _warned_names.add(full)
            log.warning("zerostall: ignoring %r: not a canonical step directory name (expected 'step-%d' "
                        "below 2**63)", full, step)
        return None
    return step


def open_regular(path: str) -> int:
    """Open ``path`` for reading only if it is a regular file (``O_NONBLOCK``: a FIFO cannot
    block the open). The caller owns the fd (blocking mode restored). ``FileNotFoundError``
    passes through; anything else odd is :class:`CorruptCheckpoint`."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except FileNotFoundError:
        raise
    except OSError as exc:
        what = "a symlink" if exc.errno == getattr(os, "ELOOP", 40) else os.strerror(exc.errno or 0)
        raise bad(path, f"cannot open ({what}); checkpoint files must be regular files") from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            kind = ("a directory" if stat.S_ISDIR(st.st_mode) else "a FIFO" if stat.S_ISFIFO(st.st_mode)
                    else "a device or socket")
            raise bad(path, f"is {kind}, not a regular file")
        os.set_blocking(fd, True)
    except BaseException:
        os.close(fd)
        raise
    return fd


def read_upto(fd: int, limit: int) -> bytes:
    """At most ``limit + 1`` bytes of ``fd`` from its offset, read in pieces: one read of
    ``limit + 1`` bytes would reserve that much memory for a file of a few KiB."""
    chunks: list[bytes] = []
    got = 0
    while got <= limit and (b := os.read(fd, min(1 << 20, limit + 1 - got))):
        chunks.append(b)
        got += len(b)
    return b"".join(chunks)


def read_small(path: str, limit: int) -> bytes:
    """Read a regular file of at most ``limit`` bytes (manifests, metadata)."""
    fd = open_regular(path)
    try:
        size = os.fstat(fd).st_size
        if size > limit:
            raise bad(path, f"file is {size} bytes, over the {limit} limit")
        raw = read_upto(fd, limit)  # the file may have grown since the fstat
        if len(raw) > limit:
            raise bad(path, f"file is over the {limit} limit")
        return raw
    finally:
        os.close(fd)


# -- plain JSON values (fast path of the state tree) -----------------------------------------
class NotPlain(Exception):
    """Raised inside :func:`plain_copy` at the first value that is not plain JSON."""


def plain_copy(x: Any, depth: int = 0) -> Any:
    """A copy of ``x`` (the save's snapshot) if it is plain JSON that round-trips unchanged (exact
    dicts with str keys, lists, str, bool, None, bounded ints, finite floats); else :class:`NotPlain`."""
    t = type(x)
    if t is str or t is bool or x is None or (t is float and x - x == 0.0) or (
            t is int and x.bit_length() <= MAX_INT_BITS):
        return x
    if depth >= MAX_DEPTH:
        raise NotPlain
    if t is list:  # a leaf inline (the test above again): no Python call per item
        return [v if (tv := type(v)) is str or tv is bool or v is None or (tv is float and v - v == 0.0) or (
            tv is int and v.bit_length() <= MAX_INT_BITS) else plain_copy(v, depth + 1) for v in x]
    if t is dict:
        d: dict[str, Any] = {}
        for k, v in x.items():
            if type(k) is not str:
                raise NotPlain
            tv = type(v)
            if tv is str or tv is bool or v is None or (tv is float and v - v == 0.0) or (
                    tv is int and v.bit_length() <= MAX_INT_BITS):
                d[k] = v
            else:
                d[k] = plain_copy(v, depth + 1)
        return d
    raise NotPlain
