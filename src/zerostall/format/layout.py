"""Shard file layout: a 4 KiB header, then tensor payloads at 4 KiB-aligned offsets.

::

    rank-RRRRR.shard (``.zst`` in checkpoints written before 0.2; not compressed)
    offset 0      header block: magic, version, JSON {checkpoint_id, step, rank, file_bytes}
                  zero-padded to 4096
    offset 4096   payload of tensor 0, zero-padded to the next 4096 boundary
    ...           payload of tensor k at the offset the manifest records
    file_bytes    end of file (a multiple of 4096; logical lengths live in the manifest)

Every write and read of a shard is therefore aligned, as O_DIRECT requires, and every byte
of the file is either covered by a crc32c (payloads), compared exactly (header) or must
be zero (padding): a flipped bit anywhere is detected.
"""

from __future__ import annotations

import json
import re
import struct
from dataclasses import dataclass

from ..config import ALIGN_BYTES
from ..errors import CorruptCheckpoint

HEADER_BYTES = ALIGN_BYTES
SHARD_SUFFIX = ".shard"
"""Shard files are ``rank-RRRRR.shard``; releases before 0.2 named them ``.zst`` though they were
never zstandard-compressed. Readers follow the names the manifest records, so both load."""
LEGACY_SHARD_SUFFIXES = (".zst",)
SHARD_NAME_RE = re.compile(r"^rank-(\d{5,})(\.shard|\.zst)$")


def shard_name(rank: int) -> str:
    """The file name every writer (Checkpointer, DCP plugin) gives rank ``rank``'s shard."""
    return f"rank-{rank:05d}{SHARD_SUFFIX}"

MAGIC = b"ZSTLSHRD"
_FIXED = struct.Struct("<8sII")  # magic, layout version, JSON length
LAYOUT_VERSION = 1


def align_up(n: int, align: int = ALIGN_BYTES) -> int:
    return (n + align - 1) // align * align


@dataclass(frozen=True)
class ShardHeader:
    checkpoint_id: str
    step: int
    rank: int
    file_bytes: int

    def encode(self) -> bytes:
        """The full ``HEADER_BYTES`` header block, zero-padded."""
        body = json.dumps({"checkpoint_id": self.checkpoint_id, "step": self.step,
                           "rank": self.rank, "file_bytes": self.file_bytes},
                          sort_keys=True, separators=(",", ":")).encode()
        raw = _FIXED.pack(MAGIC, LAYOUT_VERSION, len(body)) + body
        if len(raw) > HEADER_BYTES:
            raise ValueError("shard header does not fit in one block")
        return raw + bytes(HEADER_BYTES - len(raw))

    @classmethod
    def check(cls, block: bytes | memoryview, expected: "ShardHeader", path: str) -> None:
        """Raise :class:`CorruptCheckpoint` unless ``block`` is exactly ``expected``'s header."""
        block = bytes(block[:HEADER_BYTES])
        if block[:8] != MAGIC:
            raise CorruptCheckpoint(f"{path}: not a zerostall shard (bad magic)", path=path)
        if block != expected.encode():
            raise CorruptCheckpoint(
                f"{path}: shard header does not match the manifest (step {expected.step}, "
                f"rank {expected.rank}, checkpoint {expected.checkpoint_id}): the file was "
                f"modified, swapped or comes from another checkpoint", path=path)
