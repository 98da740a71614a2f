"""Checking a shard file as it streams in, against its step's manifest, before it is kept.

:class:`StreamCheck` is fed the file's bytes in order (any window sizes) and checks every
byte: the header block equals the one the manifest implies, each of the file's own tensors
matches its recorded crc32c, every other byte (alignment padding) is zero. Its
:meth:`~StreamCheck.digest` is computed from the bytes received (header + each tensor's crc
as read); :func:`expected_digest` computes the same from the manifest alone, so a sender
compares the receiver's acknowledgement with what it sent without reading its file again.

Owned by one thread (the one receiving the file).
"""

from __future__ import annotations

import hashlib
import struct

import crc32c as _crc

from ..errors import CorruptCheckpoint
from ..config import ALIGN_BYTES
from ..format.layout import HEADER_BYTES, ShardHeader
from ..format.manifest import FileEntry, Manifest, TensorEntry
from ..format.shard import check_items


def file_entry(man: Manifest, name: str) -> FileEntry:
    for fe in man.files:
        if fe.name == name:
            return fe
    raise CorruptCheckpoint(f"step {man.step}'s manifest lists no file {name!r}")


def own_items(man: Manifest, name: str) -> list[TensorEntry]:
    """The tensors whose bytes live in ``name`` of this step (not references to earlier steps)."""
    return sorted((e for e in man.tensors if e.file == name and e.step is None), key=lambda e: e.offset)


def _digest(header: bytes, crcs: list[int]) -> str:
    return hashlib.sha256(header + struct.pack(f"<{len(crcs)}I", *crcs)).hexdigest()


def expected_digest(man: Manifest, name: str) -> str:
    fe = file_entry(man, name)
    header = ShardHeader(fe.file_id or man.checkpoint_id, man.step, fe.rank, fe.file_bytes).encode()
    return _digest(header, [e.crc32c for e in own_items(man, name)])


class StreamCheck:
    """Checks ``name`` of ``man`` fed in file order; raises :class:`CorruptCheckpoint` at the
    first wrong byte (naming ``where`` and the tensor).

    ``start``/``end``: check only the byte range ``[start, end)`` of the file (a range fetched
    from one holder while others send the rest); ``start`` must be 0 or an offset that
    :func:`split_points` returned, so every tensor lies wholly inside one range and is checked
    against its crc32c there. Its :meth:`digest` is the whole file's only when the range is."""

    def __init__(self, man: Manifest, name: str, where: str, start: int = 0, end: int | None = None):
        fe = file_entry(man, name)
        self.where, self.size = where, fe.file_bytes
        self.start, self.end = start, fe.file_bytes if end is None else end
        self.header = ShardHeader(fe.file_id or man.checkpoint_id, man.step, fe.rank, fe.file_bytes).encode()
        every = own_items(man, name)
        check_items(where, every, fe.file_bytes)
        if not 0 <= start <= self.end <= fe.file_bytes or (start and start not in split_points(man, name)):
            raise CorruptCheckpoint(f"{where}: bytes {start}..{self.end} are not a range this file splits into",
                                    path=where)
        self.items = [e for e in every if start <= e.offset < self.end or e.offset == self.end == self.size]
        self.crcs = [0] * len(self.items)
        self.pos = start  # bytes checked so far
        self.i = 0  # first item not finished
        self.got_header = bytearray()

    def _zero(self, mv: memoryview, a: int, b: int, base: int) -> None:
        if a < b and bytes(mv[a - base:b - base]).count(0) != b - a:
            raise CorruptCheckpoint(f"{self.where}: non-zero padding in bytes {a}..{b}", path=self.where)

    def feed(self, mv: memoryview) -> None:
        base, end = self.pos, self.pos + len(mv)
        if end > self.end:
            raise CorruptCheckpoint(f"{self.where}: more than the {self.end - self.start} bytes the manifest "
                                    f"records for bytes {self.start}..{self.end}", path=self.where)
        if base < HEADER_BYTES:
            h1 = min(end, HEADER_BYTES)
            self.got_header += mv[:h1 - base]
            if len(self.got_header) == HEADER_BYTES and bytes(self.got_header) != self.header:
                raise CorruptCheckpoint(f"{self.where}: the shard header does not match the manifest",
                                        path=self.where)
        pos = max(base, HEADER_BYTES)
        j = self.i
        while j < len(self.items) and self.items[j].offset < end:
            e = self.items[j]
            a, b = max(e.offset, pos), min(e.offset + e.nbytes, end)
            self._zero(mv, pos, min(e.offset, end), base)
            if a < b:
                self.crcs[j] = _crc.crc32c(mv[a - base:b - base], self.crcs[j])
            pos = max(pos, b)
            if e.offset + e.nbytes <= end:
                if self.crcs[j] != e.crc32c:
                    raise CorruptCheckpoint(f"{self.where}: {e.key!r} failed its crc32c check (manifest "
                                            f"{e.crc32c:08x}, received {self.crcs[j]:08x})", path=self.where,
                                            key=e.key)
                self.i = j = j + 1
            else:
                break
        self._zero(mv, pos, end, base)
        self.pos = end

    def digest(self) -> str:
        """After the whole range was fed: the acknowledgement digest (see module doc)."""
        if self.pos != self.end or any(e.nbytes or e.crc32c for e in self.items[self.i:]):
            raise CorruptCheckpoint(f"{self.where}: {self.pos - self.start} of {self.end - self.start} bytes "
                                    "received", path=self.where)
        return _digest(bytes(self.got_header), self.crcs)


def split_points(man: Manifest, name: str) -> list[int]:
    """Offsets where ``name`` may be cut into ranges fetched from different holders, ascending:
    the start of each of its own tensors after the first (aligned; no tensor crosses one)."""
    out, end = [], HEADER_BYTES
    for e in own_items(man, name):
        if e.offset >= end and e.offset % ALIGN_BYTES == 0 and e.offset > HEADER_BYTES:
            out.append(e.offset)
        end = max(end, e.offset + e.nbytes)
    return out


def ranges(man: Manifest, name: str, parts: int, min_bytes: int) -> list[tuple[int, int]]:
    """``name`` cut into at most ``parts`` ranges of at least ``min_bytes`` each (about equal,
    at :func:`split_points`): ``[(start, end), ...]`` covering the file."""
    size = file_entry(man, name).file_bytes
    parts = max(1, min(parts, size // max(min_bytes, 1)))
    pts = split_points(man, name)
    cuts = [0]
    for k in range(1, parts):
        want = size * k // parts
        best = min((p for p in pts if p > cuts[-1]), key=lambda p: abs(p - want), default=None)
        if best is not None and best < size and best - cuts[-1] >= min_bytes // 2:
            cuts.append(best)
    return list(zip(cuts, cuts[1:] + [size]))
