"""Shard file layout: a 4 KiB header, then tensor payloads packed into page-aligned extents.

::

    rank-RRRRR.shard
    offset 0      header block: magic, layout version, JSON {checkpoint_id, step, rank,
                  file_bytes}, zero-padded to 4096
    offset 4096   payload of tensor 0
    ...           payload of tensor k at the offset the manifest records
    file_bytes    end of file (a multiple of 4096; logical lengths live in the manifest)

Layout 2 (the one this release reads and writes): an item of ``PAGE_ITEM_BYTES`` or more
starts on a page and owns its pages; a smaller one follows the previous item at
:func:`item_align`. Another layout is refused naming it. Files move in aligned extents only
(O_DIRECT); every byte is crc32c-covered (payloads), compared (header) or zero (padding).
"""

from __future__ import annotations

import json
import re
import struct
from dataclasses import asdict, dataclass
from typing import Sequence

from ..config import ALIGN_BYTES
from ..errors import CorruptCheckpoint

HEADER_BYTES = ALIGN_BYTES
SHARD_SUFFIX = ".shard"
SHARD_NAME_RE = re.compile(r"^rank-(\d{5,})\.shard$")
FILE_NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")
"""A plain file name inside a checkpoint (what a manifest may name)."""


def shard_name(rank: int) -> str:
    """The file name every writer (Checkpointer, DCP plugin) gives rank ``rank``'s shard."""
    return f"rank-{rank:05d}{SHARD_SUFFIX}"


MAGIC = b"ZSTLSHRD"
_FIXED = struct.Struct("<8sII")  # magic, layout version, JSON length
LAYOUT_VERSION = 2
ITEM_ALIGN = 64
"""The alignment of a packed item of ``LINE_ITEM_BYTES`` or more (a cache line; torch's own)."""
LINE_ITEM_BYTES = 4096
SMALL_ALIGN = 16
"""The alignment of a packed item under ``LINE_ITEM_BYTES``: the largest dtype's size."""
PAGE_ITEM_BYTES = 256 << 10
"""Items at least this big start on a 4 KiB boundary and own their pages."""
MANIFEST_ALIGNMENT = ITEM_ALIGN
"""The manifest's ``alignment`` field, which names the layout (``4096``: layout 1)."""


def align_up(n: int, align: int = ALIGN_BYTES) -> int:
    return (n + align - 1) // align * align


def version_advice(what: str, version: int, current: int) -> str:
    """Why ``what`` ``version`` cannot be read by this zerostall, which has only ``current``, and what to do."""
    if version < current:
        return (f"{what} {version} was written by an earlier zerostall; this zerostall reads only {what} "
                f"{current}: load the checkpoint with the zerostall that wrote it and save it again")
    return f"{what} {version} was written by a newer zerostall; this one reads only {what} {current}: upgrade zerostall"


def item_align(nbytes: int) -> int:
    """The alignment of an item of ``nbytes``: 4096 for a page item, 64 from ``LINE_ITEM_BYTES``,
    else 16 or the next power of two of ``nbytes`` if smaller (a multiple of its dtype's size)."""
    if nbytes >= PAGE_ITEM_BYTES:
        return ALIGN_BYTES
    if nbytes >= LINE_ITEM_BYTES:
        return ITEM_ALIGN
    return min(SMALL_ALIGN, 1 << max(0, nbytes - 1).bit_length())


def item_end(offset: int, nbytes: int) -> int:
    """Where the next item may start after this one: its end, or its page boundary for a page item."""
    end = offset + nbytes
    return align_up(end) if nbytes >= PAGE_ITEM_BYTES else end


def place(pos: int, nbytes: int) -> tuple[int, int]:
    """(offset, next position) of an item of ``nbytes`` placed at the first free ``pos``."""
    off = align_up(pos, item_align(nbytes))
    return off, item_end(off, nbytes)


def pack_offsets(sizes: Sequence[int], start: int = HEADER_BYTES) -> tuple[list[int], int]:
    """Offsets for items of ``sizes`` bytes, in order, from ``start`` (a page boundary), and the
    file's length: the one offset assignment (save plan, incremental saves, DCP plugin)."""
    # place() inlined (a test compares them over random sizes): no Python call per tensor
    offsets, pos = [], start
    append = offsets.append
    small, page, line, mask = _SMALL_ALIGN, PAGE_ITEM_BYTES, LINE_ITEM_BYTES, ALIGN_BYTES - 1
    for n in sizes:
        if n >= page:
            off = (pos + mask) & ~mask
            pos = (off + n + mask) & ~mask
        else:
            a = (ITEM_ALIGN if n >= line else SMALL_ALIGN if n > 8 else small[n]) - 1
            off = (pos + a) & ~a
            pos = off + n
        append(off)
    return offsets, max(align_up(pos), start)


_SMALL_ALIGN = tuple(min(SMALL_ALIGN, 1 << max(0, n - 1).bit_length()) for n in range(9))
""":func:`item_align` of items of 0-8 bytes (larger small items: ``SMALL_ALIGN``)."""


@dataclass(frozen=True)
class ShardHeader:
    checkpoint_id: str
    step: int
    rank: int
    file_bytes: int

    def encode(self) -> bytes:
        """The full ``HEADER_BYTES`` header block, zero-padded."""
        body = json.dumps(asdict(self), sort_keys=True, separators=(",", ":")).encode()
        raw = _FIXED.pack(MAGIC, LAYOUT_VERSION, len(body)) + body
        if len(raw) > HEADER_BYTES:
            raise ValueError("shard header does not fit in one block")
        return raw + bytes(HEADER_BYTES - len(raw))

    @staticmethod
    def version_of(block: bytes | memoryview) -> int:
        """The layout version a header block says (0 if it is too short to say)."""
        return _FIXED.unpack_from(block)[1] if len(block) >= _FIXED.size else 0

    def matches(self, block: bytes | memoryview) -> bool:
        """Whether ``block`` is exactly this header."""
        return bytes(block[:HEADER_BYTES]) == self.encode()

    @classmethod
    def check(cls, block: bytes | memoryview, expected: "ShardHeader", path: str) -> None:
        """Raise :class:`CorruptCheckpoint` unless ``block`` is ``expected``'s header (naming
        the file's layout and what to do when it is not :data:`LAYOUT_VERSION`)."""
        block = bytes(block[:HEADER_BYTES])
        if block[:8] != MAGIC:
            raise CorruptCheckpoint(f"{path}: not a zerostall shard (bad magic)", path=path)
        version = cls.version_of(block)
        if version != LAYOUT_VERSION:
            raise CorruptCheckpoint(f"{path}: {version_advice('shard layout version', version, LAYOUT_VERSION)}",
                                    path=path)
        if not expected.matches(block):
            raise CorruptCheckpoint(
                f"{path}: shard header does not match the manifest (step {expected.step}, "
                f"rank {expected.rank}, checkpoint {expected.checkpoint_id}): the file was "
                f"modified, swapped or comes from another checkpoint", path=path)
