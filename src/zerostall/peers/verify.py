"""Checking a shard file as it arrives, against its step's manifest, before it is kept: the header
block equals the one the manifest implies, each of the file's own tensors matches its recorded
crc32c, every other byte (alignment padding) is zero. Nothing is read back.

:class:`StreamCheck` takes the bytes in file order (one thread); its :meth:`~StreamCheck.digest`
(header + each tensor's crc as read) equals :func:`expected_digest`, computed from the manifest
alone, so a sender checks the receiver's acknowledgement without reading its file again.

:class:`PieceCheck` takes pieces at any offsets from several threads (a rebuild from coded
fragments). Each piece belongs to a *source* (a fragment index) whose pieces come in file order;
a failed source is :meth:`~PieceCheck.forget`-ten before it is fed again. A tensor one source
sends whole is judged at its last byte; one that straddles two sources by
:meth:`~PieceCheck.finish` (before, which part is wrong cannot be told).
"""

from __future__ import annotations

import bisect
import hashlib
import struct
import threading

import crc32c as _crc

from ..errors import CorruptCheckpoint
from ..config import ALIGN_BYTES
from ..format.crc_combine import combine
from ..format.layout import HEADER_BYTES, ShardHeader
from ..format.manifest import FileEntry, Manifest, TensorEntry
from ..format.shard import ShardCursor, check_items

__all__ = ["PieceCheck", "StreamCheck", "expected_digest", "file_entry", "ranges", "split_points"]


def file_entry(man: Manifest, name: str) -> FileEntry:
    for fe in man.files:
        if fe.name == name:
            return fe
    raise CorruptCheckpoint(f"step {man.step}'s manifest lists no file {name!r}")


def own_items(man: Manifest, name: str) -> list[TensorEntry]:
    """The tensors whose bytes live in ``name`` of this step (not references to earlier steps)."""
    return sorted((e for e in man.tensors if e.file == name and e.step is None), key=lambda e: e.offset)


def _header(man: Manifest, fe: FileEntry) -> ShardHeader:
    return ShardHeader(fe.file_id or man.checkpoint_id, man.step, fe.rank, fe.file_bytes)


def _digest(header: bytes, crcs: list[int]) -> str:
    return hashlib.sha256(header + struct.pack(f"<{len(crcs)}I", *crcs)).hexdigest()


def expected_digest(man: Manifest, name: str) -> str:
    return _digest(_header(man, file_entry(man, name)).encode(), [e.crc32c for e in own_items(man, name)])


class _FileCheck:
    """``name`` of ``man``: its header block and own tensors; errors name ``where``."""

    def __init__(self, man: Manifest, name: str, where: str):
        fe = file_entry(man, name)
        self.where, self.size = where, fe.file_bytes
        self.head = _header(man, fe)
        self.header = self.head.encode()
        self.items = own_items(man, name)
        check_items(where, self.items, fe.file_bytes)

    def _bad(self, what: str, key: str | None = None) -> CorruptCheckpoint:
        return CorruptCheckpoint(f"{self.where}: {what}", path=self.where, key=key)

    def _zero(self, mv: memoryview, base: int, a: int, b: int) -> None:
        """Bytes ``[a, b)`` of the file (``mv`` starts at ``base``) must be zero."""
        if a < b and bytes(mv[a - base:b - base]).count(0) != b - a:
            raise self._bad(f"non-zero padding in bytes {a}..{b}")

    def _crc_error(self, e: TensorEntry, crc: int, why: str = "") -> CorruptCheckpoint:
        return self._bad(f"{e.key!r} failed its crc32c check (manifest {e.crc32c:08x}, received {crc:08x}{why})",
                         e.key)


class StreamCheck(_FileCheck):
    """Checks ``name`` of ``man`` fed in file order (a :class:`~zerostall.format.shard.ShardCursor`
    that copies nothing); raises :class:`CorruptCheckpoint` at the first wrong byte.
    ``start``/``end``: only bytes ``[start, end)`` (``start`` 0 or one of :func:`split_points`,
    so every tensor lies wholly inside one range)."""

    def __init__(self, man: Manifest, name: str, where: str, start: int = 0, end: int | None = None):
        super().__init__(man, name, where)
        self.start, self.end = start, self.size if end is None else end
        if not 0 <= start <= self.end <= self.size or (start and start not in split_points(man, name)):
            raise self._bad(f"bytes {start}..{self.end} are not a range this file splits into")
        self.items = [e for e in self.items if start <= e.offset < self.end or e.offset == self.end == self.size]
        self.pos = start  # bytes checked so far
        self.cursor = ShardCursor(where, self.head, self.items, lambda i: None)

    def feed(self, mv: memoryview) -> None:
        if self.pos + len(mv) > self.end:
            raise self._bad(f"more than the {self.end - self.start} bytes the manifest records for bytes "
                            f"{self.start}..{self.end}")
        self.cursor.feed(self.pos, mv, None)
        self.pos += len(mv)

    def digest(self) -> str:
        """After the whole range was fed: the acknowledgement digest (see module doc)."""
        if self.pos != self.end:
            raise self._bad(f"{self.pos - self.start} of {self.end - self.start} bytes received")
        self.cursor.finish(None)
        return _digest(self.header[:self.end] if self.start == 0 else b"", [e.crc32c for e in self.items])


def split_points(man: Manifest, name: str) -> list[int]:
    """Offsets where ``name`` may be cut into ranges, ascending: aligned tensor starts no tensor crosses."""
    out, end = [], HEADER_BYTES
    for e in own_items(man, name):
        if e.offset >= end and e.offset % ALIGN_BYTES == 0 and e.offset > HEADER_BYTES:
            out.append(e.offset)
        end = max(end, e.offset + e.nbytes)
    return out


def ranges(man: Manifest, name: str, parts: int, min_bytes: int) -> list[tuple[int, int]]:
    """``name`` cut at :func:`split_points` into at most ``parts`` about equal ranges of at least
    ``min_bytes``: ``[(start, end), ...]``."""
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


class PieceCheck(_FileCheck):
    """``name`` of ``man``, checked piece by piece (module doc). :meth:`feed` from any thread
    (one thread per source at a time), :meth:`finish` once every source is in."""

    def __init__(self, man: Manifest, name: str, where: str):
        super().__init__(man, name, where)
        self._starts = [e.offset for e in self.items]
        self._mu = threading.Lock()
        self._segs: list[dict[int, tuple[int, int, int]]] = [{} for _ in self.items]  # start -> (end, crc, source)
        self._done = [e.nbytes == 0 and e.crc32c == 0 for e in self.items]
        self._cover: dict[int, list[list[int]]] = {}  # source -> merged [start, end) runs checked

    def feed(self, source: int, offset: int, mv: memoryview) -> None:
        """Check bytes ``[offset, offset + len(mv))`` of the file, from ``source``."""
        a, b = offset, offset + len(mv)
        if a < 0 or b > self.size:
            raise self._bad(f"bytes {a}..{b} lie outside the {self.size}-byte file")
        if a < HEADER_BYTES and bytes(mv[:min(b, HEADER_BYTES) - a]) != self.header[a:min(b, HEADER_BYTES)]:
            raise self._bad("the shard header does not match the manifest")
        pos = max(a, HEADER_BYTES)
        j = max(0, bisect.bisect_right(self._starts, pos) - 1)
        parts = []
        while j < len(self.items) and self.items[j].offset < b:
            e = self.items[j]
            end = e.offset + e.nbytes
            if end <= pos:
                j += 1
                continue
            self._zero(mv, a, pos, min(e.offset, b))
            s, t = max(e.offset, pos), min(end, b)
            if s < t:  # crc32c releases the GIL: outside the lock
                parts.append((j, s, t, _crc.crc32c(mv[s - a:t - a])))
            pos = max(pos, t)
            if end > b:
                break
            j += 1
        self._zero(mv, a, pos, b)
        with self._mu:
            runs = self._cover.setdefault(source, [])
            if runs and runs[-1][1] == a:
                runs[-1][1] = b
            else:
                runs.append([a, b])
            for j, s, t, c in parts:
                self._add(j, s, t, c, source)

    def _add(self, j: int, s: int, t: int, c: int, source: int) -> None:
        segs, e = self._segs[j], self.items[j]
        prev = next((k for k, (end, _, src) in segs.items() if end == s and src == source), None)
        if prev is not None:  # the same stream goes on
            _, crc, _ = segs[prev]
            segs[prev] = (t, combine(crc, c, t - s), source)
        else:
            segs[s] = (t, c, source)
        crc = self._whole(j)
        if crc is not None and len({src for _, _, src in segs.values()}) == 1:
            if crc != e.crc32c:  # one source sent the whole tensor: that source is at fault
                raise self._crc_error(e, crc)
            self._done[j] = True
        # a tensor two sources share is judged by finish() (module doc)

    def _whole(self, j: int) -> int | None:
        """Tensor ``j``'s crc32c when its parts cover it exactly, else None."""
        e, pos, crc = self.items[j], self.items[j].offset, 0
        for start in sorted(self._segs[j]):
            end, part, _ = self._segs[j][start]
            if start != pos:
                return None  # a part is still missing (or overlaps)
            crc, pos = combine(crc, part, end - start), end
        return crc if pos == e.offset + e.nbytes else None

    def forget(self, source: int) -> None:
        """Drop everything ``source`` fed (it failed; it may be fed again from the start)."""
        with self._mu:
            self._cover.pop(source, None)
            for j, segs in enumerate(self._segs):
                for start in [k for k, v in segs.items() if v[2] == source]:
                    del segs[start]
                    self._done[j] = False

    def finish(self) -> None:
        """Raise unless every byte of the file was checked exactly once and every tensor passed."""
        with self._mu:
            runs = sorted((a, b) for r in self._cover.values() for a, b in r)
            pos, tiled = 0, True
            for a, b in runs:
                if a != pos:  # a gap, or bytes fed twice
                    tiled = False
                    break
                pos = b
            for j, e in enumerate(self.items):
                if not self._done[j] and (crc := self._whole(j)) is not None:
                    if crc != e.crc32c:
                        raise self._crc_error(e, crc, "; its bytes came from two fragments")
                    self._done[j] = True
            missing = [e.key for e, ok in zip(self.items, self._done) if not ok]
        if not tiled or pos != self.size or missing:
            raise self._bad(f"{pos} of {self.size} bytes checked once, in order"
                            + (f"; tensors not checked: {', '.join(map(repr, missing[:5]))}" if missing else ""))
