"""The one shard codec (layout: :mod:`.layout`): items written into a shard file and read back checked.

Used by the Checkpointer (persist thread: :class:`CrcCursor`; restore pipeline:
:class:`ShardCursor`) and the DCP plugin (:func:`write_shard`, :func:`read_shard`), so both
check the header exactly, every item's crc32c, and that every other byte read is zero.
Everything runs on the calling thread. Buffers (``buf``/``bounce``) are the caller's
page-aligned mappings with ``mv``, ``u8`` and ``nbytes`` (an :class:`~zerostall.memory.arena.Arena`
is one). Never opens files: the caller passes an open engine file, so ``io/`` alone moves bytes.
"""

from __future__ import annotations

import functools
from typing import Any, Callable, Protocol, Sequence

import crc32c as _crc
import torch

from ..config import ALIGN_BYTES
from .validate import bad
from .layout import PAGE_ITEM_BYTES, HEADER_BYTES, ShardHeader, align_up, item_align, item_end, pack_offsets

__all__ = ["CrcCursor", "Item", "ShardCursor", "check_items", "pack_offsets", "read_runs", "read_shard",
           "write_shard"]


class Item(Protocol):
    """What the codec needs to know of one stored item (``TensorEntry`` is one)."""

    key: str
    offset: int
    nbytes: int
    crc32c: int


class CrcCursor:
    """Per-item crc32c over a shard's bytes, fed in file order, extent by extent (``items``
    sorted by offset, disjoint). Owned by the one thread that feeds it."""

    def __init__(self, items: Sequence[Any]):
        self.items = items
        self.crcs = [0] * len(items)
        self.i = 0

    def feed(self, extents: Sequence[tuple[int, memoryview]]) -> None:
        for foff, mv in extents:
            end = foff + len(mv)
            while self.i < len(self.items):
                it = self.items[self.i]
                a, b = max(it.offset, foff), min(it.offset + it.nbytes, end)
                if a < b:
                    self.crcs[self.i] = _crc.crc32c(mv[a - foff:b - foff], self.crcs[self.i])
                if it.offset + it.nbytes <= end:
                    self.i += 1  # finished (or empty); move on
                else:
                    break


def write_shard(f: Any, header: ShardHeader, payloads: Sequence[torch.Tensor], offsets: Sequence[int],
                buf: Any) -> list[int]:
    """Write a whole shard through ``buf`` into the engine file ``f``: flat uint8 CPU
    ``payloads`` at ``offsets``, zeros elsewhere. Returns each payload's crc32c over the bytes
    handed to the engine. The caller calls ``f.finish()`` (fdatasync) and closes ``f``."""
    file_bytes = header.file_bytes
    block = torch.frombuffer(bytearray(header.encode()), dtype=torch.uint8)
    crcs = [0] * len(payloads)
    win = buf.nbytes // ALIGN_BYTES * ALIGN_BYTES
    first = 0
    for w0 in range(0, file_bytes, win):
        w1 = min(w0 + win, file_bytes)
        buf.u8[:w1 - w0].zero_()
        if w0 == 0:
            buf.u8[:HEADER_BYTES].copy_(block)
        i = first
        while i < len(payloads) and offsets[i] < w1:
            o, flat = offsets[i], payloads[i]
            a, b = max(o, w0), min(o + flat.numel(), w1)
            if a < b:
                buf.u8[a - w0:b - w0].copy_(flat[a - o:b - o])
                crcs[i] = _crc.crc32c(buf.mv[a - w0:b - w0], crcs[i])
            if o + flat.numel() <= w1 and i == first:
                first += 1
            i += 1
        f.write([(w0, buf.mv[:w1 - w0])])
    return crcs


def check_items(path: str, items: Sequence[Item], file_bytes: int) -> None:
    """Items sorted by offset lie after the header, aligned, inside the file, without overlap."""
    end = HEADER_BYTES
    for it in items:
        if (it.nbytes < 0 or it.offset % item_align(it.nbytes) or it.offset < end
                or it.offset + it.nbytes > file_bytes):
            raise bad(path, f"item {it.key!r} at offset {it.offset} ({it.nbytes} bytes) is unaligned, overlaps "
                      f"the header or the previous item, or lies outside the {file_bytes}-byte file", it.key)
        end = item_end(it.offset, it.nbytes)


def read_runs(items: Sequence[Item], wanted: set[int] | None, file_bytes: int) -> list[tuple[int, int]]:
    """The aligned byte ranges to read: the whole file, or the header and the wanted items' pages."""
    if wanted is None:
        return [(0, file_bytes)]
    runs = [(0, HEADER_BYTES)]
    for i in sorted(wanted, key=lambda i: items[i].offset):
        o = items[i].offset
        a, b = o - o % ALIGN_BYTES, min(align_up(o + items[i].nbytes), file_bytes)
        if a <= runs[-1][1]:
            runs[-1] = (runs[-1][0], max(runs[-1][1], b))
        else:
            runs.append((a, b))
    return runs


class ShardCursor:
    """Checks a shard fed window by window, in file order, and copies items into ``dsts``.

    ``items`` are sorted by offset; ``dsts[i]`` (or ``dsts(i)``, called at item ``i``'s first
    byte) is a flat uint8 CPU tensor to fill, the int address of writable bytes the caller keeps
    alive (moved by :meth:`feed`'s ``copy``), or None (checked only). ``on_item(i)``: item ``i`` is complete and passed its crc32c.
    ``wanted``: a partial read (:func:`read_runs`): only those items are checked and copied, and
    only the padding a page item owns, unless ``listed`` (``items`` are all of the file's).
    Owned by one thread (the restore pipeline's consumer, or :func:`read_shard`'s caller).
    """

    def __init__(self, path: str, header: ShardHeader, items: Sequence[Item],
                 dsts: Sequence[torch.Tensor | None] | Callable[[int], torch.Tensor | None], *,
                 verify: bool = True, on_item: Callable[[int], None] | None = None,
                 wanted: set[int] | None = None, listed: bool = False):
        self.path, self.header, self.items, self.verify, self.on_item = path, header, items, verify, on_item
        self.wanted, self.listed = wanted, listed
        self.gaps = verify and (wanted is None or listed)  # every padding byte checked (see the class doc)
        self.crcs = [0] * len(items)
        self.first = 0  # items before this one are finished (or were skipped)
        self.finished = [False] * len(items)
        self.get = dsts if callable(dsts) else dsts.__getitem__
        self.open_dsts: dict[int, torch.Tensor | None] = {}  # items started but not finished

    def feed(self, w0: int, mv: memoryview, u8: torch.Tensor,
             copy: Callable[[int, Any, Any, int], Any] | None = None, addr: int = 0) -> None:
        """Check the file bytes ``[w0, w0 + len(mv))`` (``u8`` views the same memory, at
        ``addr``). ``copy(i, dst, src, n)`` moves item ``i``'s bytes to an address ``dst``."""
        items, path, verify, crcs, gaps, wanted = self.items, self.path, self.verify, self.crcs, self.gaps, self.wanted
        w1 = w0 + len(mv)
        if w0 == 0 and verify:
            ShardHeader.check(mv[:HEADER_BYTES], self.header, path)
        tails = verify and not gaps
        while self.first < len(items) and _done_before(items[self.first], w0):
            self.first += 1
        pos = max(w0, HEADER_BYTES)  # [w0, pos) is header or payload already walked
        j = self.first
        while j < len(items) and items[j].offset < w1:
            e = items[j]
            j += 1
            if _done_before(e, w0):
                continue
            end = e.offset + e.nbytes
            a, b = max(e.offset, w0), min(end, w1)
            if gaps and a > pos and not _zeros(mv[pos - w0:a - w0]):
                raise bad(path, f"non-zero padding before {e.key!r}", e.key)
            if wanted is not None and j - 1 not in wanted:  # a neighbour on a page read: not checked
                pos = max(pos, b)
                continue
            if a < b:
                if j - 1 not in self.open_dsts:
                    self.open_dsts[j - 1] = self.get(j - 1)
                dst = self.open_dsts[j - 1]
                if isinstance(dst, int):  # an address: no tensor op per item (100k-tensor states)
                    copy(j - 1, dst + a - e.offset, addr + a - w0, b - a)  # type: ignore[misc]
                elif dst is not None:
                    dst[a - e.offset:b - e.offset].copy_(u8[a - w0:b - w0])
                if verify:
                    crcs[j - 1] = _crc.crc32c(mv[a - w0:b - w0], crcs[j - 1])
            pos = max(pos, b)
            if (tails and end < w1 and e.nbytes >= PAGE_ITEM_BYTES  # the padding a page item owns
                    and not _zeros(mv[end - w0:min(align_up(end), w1) - w0])):
                raise bad(path, f"non-zero padding after {e.key!r}", e.key)
            if end <= w1:  # complete in this window
                if verify and crcs[j - 1] != e.crc32c:
                    raise bad(path, f"{e.key!r} failed its crc32c check (recorded {e.crc32c:08x}, "
                              f"read {crcs[j - 1]:08x})", e.key)
                self.finished[j - 1] = True
                self.open_dsts.pop(j - 1, None)
                if self.on_item is not None:
                    self.on_item(j - 1)
        if gaps and pos < w1 and not _zeros(mv[pos - w0:w1 - w0]):
            raise bad(path, f"non-zero padding at offset {pos}")

    def finish(self, wanted: set[int] | None) -> None:
        """After the last window: every item (or every wanted one) was found."""
        for i in (range(len(self.items)) if wanted is None else sorted(wanted)):
            if not self.finished[i]:  # only an empty item at the very end of the file gets here
                e = self.items[i]
                if e.nbytes or (self.verify and e.crc32c != 0):
                    raise bad(self.path, f"{e.key!r} was not found in the file", e.key)
                if self.on_item is not None:
                    self.on_item(i)


def read_shard(f: Any, path: str, file_bytes: int, header: ShardHeader, items: Sequence[Item],
               dsts: Sequence[torch.Tensor | None] | Callable[[int], torch.Tensor | None], bounce: Any, *,
               verify: bool = True,
               wanted: set[int] | None = None, on_item: Callable[[int], None] | None = None,
               listed: bool = False) -> None:
    """Stream a shard through ``bounce``, checking it, and copy items into ``dsts`` (arguments:
    :class:`ShardCursor`). Raises :class:`CorruptCheckpoint` naming ``path`` and the item."""
    win = bounce.nbytes // ALIGN_BYTES * ALIGN_BYTES
    cur = ShardCursor(path, header, items, dsts, verify=verify, on_item=on_item, wanted=wanted, listed=listed)
    for r0, r1 in read_runs(items, wanted, file_bytes):
        for w0 in range(r0, r1, win):
            w1 = min(w0 + win, r1)
            f.read([(w0, bounce.mv[:w1 - w0])])
            cur.feed(w0, bounce.mv[:w1 - w0], bounce.u8[:w1 - w0])
    cur.finish(wanted)


@functools.lru_cache(maxsize=256)
def _zero_bytes(n: int) -> bytes:
    return bytes(n)


def _zeros(mv: memoryview) -> bool:
    """Whether every byte of ``mv`` is zero (a small gap by a bytes compare: cheaper than ``Tensor.any``)."""
    n = len(mv)
    if n > 1 << 16:
        return not torch.frombuffer(mv, dtype=torch.uint8).any().item()
    return mv.tobytes() == _zero_bytes(n)


def _done_before(e: Item, w0: int) -> bool:
    """Whether item ``e`` was completed by a window before the one starting at ``w0``."""
    return e.offset < w0 and e.offset + e.nbytes <= w0
