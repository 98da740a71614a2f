"""The windows of a restore read: which byte ranges of which files, into which memory (a ring
slot, an in-place ``swap`` or ``stage`` place in the scratch, or the destination: ``direct``).
Pure layout, no I/O: :class:`.stream.Plan`, caller's thread.
"""

from __future__ import annotations

import threading
from typing import TYPE_CHECKING, Any, Sequence

import torch

from ..config import ALIGN_BYTES, IOConfig
from ..errors import CorruptCheckpoint
from ..format.shard import check_items, read_runs

if TYPE_CHECKING:
    from .stream import FileRead

MAX_WINDOW_BYTES, MIN_SLOTS = 64 << 20, 4
READERS = 2  # reader threads (:mod:`.stream`), each keeping the engine's queue depth in flight


class _Win:
    __slots__ = ("fi", "off", "n", "kind", "slot", "buf", "done", "error")

    def __init__(self, fi: int, off: int, n: int, kind: str, buf: torch.Tensor | None = None, slot: int = -1):
        self.fi, self.off, self.n, self.kind, self.buf, self.slot = fi, off, n, kind, buf, slot
        self.done = threading.Event()
        self.error: BaseException | None = None


def window_bytes(io: IOConfig) -> int:
    """One window: enough requests of ``chunk_bytes`` that READERS windows fill the queue."""
    return max(ALIGN_BYTES, min(MAX_WINDOW_BYTES, io.chunk_bytes * max(1, io.queue_depth // READERS)))


def _cut(fi: int, a: int, b: int, w: int, kind: str, out: list[_Win], buf: torch.Tensor | None = None) -> None:
    for p in range(a, b, w):
        q = min(p + w, b)
        out.append(_Win(fi, p, q - p, kind, buf[p - a:q - a] if buf is not None else None))


def plan_windows(files: Sequence[FileRead], w: int) -> list[_Win]:
    """Every byte range to read, in file order: ``direct`` windows, and ``ring`` ones (placed by
    :func:`_layout`)."""
    out: list[_Win] = []
    for fi, fr in enumerate(files):
        check_items(fr.path, fr.items, fr.file_bytes)
        dext = sorted((fr.items[i].offset, buf) for i, buf in fr.direct.items())
        k = 0
        for r0, r1 in read_runs(fr.items, fr.wanted, fr.file_bytes):
            pos = r0
            while k < len(dext) and dext[k][0] < r1:
                a, buf = dext[k]
                k += 1
                if a < pos or a + buf.numel() > r1:
                    raise CorruptCheckpoint(f"{fr.path}: item at offset {a} overlaps another", path=fr.path)
                _cut(fi, pos, a, w, "ring", out)
                _cut(fi, a, a + buf.numel(), w, "direct", out, buf)
                pos = a + buf.numel()
            _cut(fi, pos, r1, w, "ring", out)
    return out


def _layout(wins: list[_Win], scratch: Any, w: int, in_place: bool, fraction: float, ring: Any = None) -> int:
    """Give each ``ring`` window a ring slot or (in place) its own place in the scratch: ``swap``
    for the first ``fraction`` of the bytes, then ``stage``; in a split read (a separate
    ``ring``) those past ``scratch.nbytes`` stay ``ring`` windows. Returns the ring slots."""
    ring_wins = [x for x in wins if x.kind == "ring"]
    split = in_place and ring is not None and ring is not scratch
    placed: list[_Win] = []
    if in_place:
        at = 0
        for x in ring_wins:  # in file order, while they fit (all of them but in a split read)
            if split and at + x.n > scratch.nbytes:
                break
            placed.append(x)
            at += x.n
        cut, at = int(at * fraction), 0
        for x in placed:
            x.kind, x.buf = ("swap" if at < cut else "stage"), scratch.u8[at:at + x.n]
            at += x.n
        if not split:
            return 0
    slots = max(1, min(8, (ring if split else scratch).nbytes // w))
    for r, x in enumerate(ring_wins[len(placed):]):
        x.slot = r % slots
    return slots
