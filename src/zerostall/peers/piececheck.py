"""Checking a shard file whose bytes arrive in pieces at any offsets, from several threads, against
its step's manifest as each piece arrives, before it is written: nothing is read back.

A rebuild from coded fragments (:mod:`.coded_restore`) needs this: each data fragment is a byte
range of the node's files, streamed by a fetch thread of its own, and a missing one is decoded
by another thread, so no file arrives in order. What is checked is what :class:`.verify.StreamCheck`
checks in order: the header block equals the one the manifest implies, each of the file's own
tensors matches its recorded crc32c, every other byte (alignment padding) is zero.

Each piece belongs to a *source* (a fragment index) whose pieces come in file order from one
thread at a time. A source that failed (a cut stream, a wrong byte) is :meth:`PieceCheck.forget`-ten
before it is fed again (from the next holder, or decoded). A tensor that straddles two sources
(a fragment boundary) is checked once both parts are in, its crc32c combined from the parts'
(:func:`~zerostall.format.crc_combine.combine`) at :meth:`PieceCheck.finish`, once every source's
own crc32c passed (which part is wrong cannot be told before). A tensor that one source sends
whole is judged as its last byte arrives, so a stream with a wrong byte stops at the first
tensor it finishes, not at its last byte.
"""

from __future__ import annotations

import bisect
import threading

import crc32c as _crc

from ..errors import CorruptCheckpoint
from ..format.crc_combine import combine
from ..format.layout import HEADER_BYTES, ShardHeader
from ..format.manifest import Manifest
from ..format.shard import check_items
from .verify import file_entry, own_items

__all__ = ["PieceCheck"]


class PieceCheck:
    """``name`` of ``man``, checked piece by piece (module doc). :meth:`feed` from any thread
    (one thread per source at a time), :meth:`finish` once every source is in."""

    def __init__(self, man: Manifest, name: str, where: str):
        fe = file_entry(man, name)
        self.where, self.size = where, fe.file_bytes
        self.header = ShardHeader(fe.file_id or man.checkpoint_id, man.step, fe.rank, fe.file_bytes).encode()
        self.items = own_items(man, name)
        check_items(where, self.items, fe.file_bytes)
        self._starts = [e.offset for e in self.items]
        self._mu = threading.Lock()
        self._segs: list[dict[int, tuple[int, int, int]]] = [{} for _ in self.items]  # start -> (end, crc, source)
        self._done = [e.nbytes == 0 and e.crc32c == 0 for e in self.items]
        self._cover: dict[int, list[list[int]]] = {}  # source -> merged [start, end) runs checked

    def _bad(self, what: str, key: str | None = None) -> CorruptCheckpoint:
        return CorruptCheckpoint(f"{self.where}: {what}", path=self.where, key=key)

    def feed(self, source: int, offset: int, mv: memoryview) -> None:
        """Check bytes ``[offset, offset + len(mv))`` of the file, from ``source``; raises
        :class:`CorruptCheckpoint` naming the tensor (or the header, or the padding) at fault."""
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

    def _zero(self, mv: memoryview, base: int, a: int, b: int) -> None:
        if a < b and bytes(mv[a - base:b - base]).count(0) != b - a:
            raise self._bad(f"non-zero padding in bytes {a}..{b}")

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
                raise self._bad(f"{e.key!r} failed its crc32c check (manifest {e.crc32c:08x}, received {crc:08x})",
                                e.key)
            self._done[j] = True
        # a tensor two sources share is judged by :meth:`finish`, once every source's own
        # crc32c passed: a wrong part of it may come from either, and the one that ends it
        # first is not the one to blame

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
                        raise self._bad(f"{e.key!r} failed its crc32c check (manifest {e.crc32c:08x}, received "
                                        f"{crc:08x}; its bytes came from two fragments)", e.key)
                    self._done[j] = True
            missing = [e.key for e, ok in zip(self.items, self._done) if not ok]
        if not tiled or pos != self.size or missing:
            raise self._bad(f"{pos} of {self.size} bytes checked once, in order"
                            + (f"; tensors not checked: {', '.join(map(repr, missing[:5]))}" if missing else ""))
