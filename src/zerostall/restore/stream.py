"""The restore read pipeline: deep direct reads, checks and copies overlapped, like the save.

Called from the caller's thread by :mod:`.step` with one step's shard files (its own and those
it borrows), cut into aligned windows (:func:`plan_windows`, pure layout, no I/O). Threads,
joined before it returns:

- ``READERS`` readers (``zerostall-restore-read``), each with its own reader of every file,
  claim windows in file order and read each into its buffer: a ring slot in the scratch, a
  place in the scratch kept until the end, or the destination itself (``direct``);
- the caller's thread checks each window in order (:class:`~zerostall.format.shard.ShardCursor`:
  header, padding, crc32c) while the next are read, and hands the copies to
- ``COPIERS`` copiers (``zerostall-restore-copy``), which free a ring slot once its copies are
  done (how bytes move: :mod:`.device_copy`).

Transactional in-place loads (``FileRead.protect``: the caller's tensors) read every byte once,
each window in its own place in the scratch. The first :data:`ROLLBACK_FRACTION` of the bytes
is *swapped* with the caller's as soon as it verified (the scratch then holds the rollback
copy); the rest stays staged until every byte verified and the gate passed. A failure copies
the swapped bytes back. The scratch is the caller's (:func:`.step.read_step`).
"""

from __future__ import annotations

import ctypes
import os
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import torch

from ..config import ALIGN_BYTES, IOConfig
from ..errors import CorruptCheckpoint
from ..format.layout import ShardHeader, align_up
from ..format.shard import Item, ShardCursor, check_items, read_runs
from .device_copy import CudaCopier, copy_staged, rollback, swap

ROLLBACK_FRACTION = 1.0  # share of an in-place load swapped in under rollback while reading (the rest staged)
ADAPTIVE = True  # swaps not started when every byte verified become staged copies (one copy's traffic)
DIRECT_MIN_BYTES = 1 << 62  # new tensors this big are read into directly (off: docs/speed-tricks.md)
COPIERS = 2


@dataclass
class FileRead:
    """One shard file to read: ``items`` sorted by offset, ``dsts[i]`` the address to fill (kept
    alive by the caller; None: checked only, or read into ``direct[i]``, a page-aligned flat
    uint8 tensor of ``align_up(nbytes)`` bytes)."""

    path: str
    file_bytes: int
    header: ShardHeader
    items: Sequence[Item]
    dsts: list[int | None]
    open: Callable[[], Any]
    wanted: set[int] | None = None
    direct: dict[int, torch.Tensor] = field(default_factory=dict)
    protect: set[int] = field(default_factory=set)
    """Items whose ``dsts`` are the caller's tensors: written only transactionally."""
    device: dict[int, torch.Tensor] = field(default_factory=dict)
    """Items whose destination is CUDA memory: a flat uint8 CUDA tensor (``dsts[i]`` its address)."""


@dataclass
class Stats:
    bytes_read: int = 0
    windows: int = 0
    wait_s: float = 0.0  # time the checking thread waited for reads
    deferred_bytes: int = 0
    rollback_bytes: int = 0
    later: dict[int, set[int]] = field(default_factory=dict)
    """A split read (``Plan.run(head=)``): protected items checked but not delivered, per file."""
    device_bytes: int = 0
    written_bytes: int = 0
    """Bytes handed to the copiers for unprotected destinations (written as they verify)."""


MAX_WINDOW_BYTES, MIN_SLOTS = 64 << 20, 4
READERS = 2  # reader threads, each keeping the engine's queue depth in flight


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


class Plan:
    """The windows of one read of ``files`` and the scratch it needs (caller's thread)."""

    def __init__(self, files: Sequence[FileRead], io: IOConfig, *, in_place: bool):
        self.files, self.in_place = files, in_place
        self.w = window_bytes(io)
        wins = plan_windows(files, self.w)
        self.ring_bytes = sum(x.n for x in wins if x.kind == "ring")  # read through the scratch
        self.stats: Stats | None = None  # the last run's, also when it raised

    def need_bytes(self) -> int:
        return self.ring_bytes if self.in_place else MIN_SLOTS * self.w

    def fits(self, scratch_bytes: int) -> bool:
        return self._window_for(scratch_bytes, split=False) is not None

    def _window_for(self, scratch_bytes: int, *, split: bool) -> int | None:
        """The window bytes for ``scratch_bytes`` of scratch (in place: all of ``ring_bytes``;
        else a ring as large as fits), or None if it does not fit."""
        if self.in_place and not split:
            return self.w if scratch_bytes >= self.ring_bytes else None
        w = min(self.w, scratch_bytes // MIN_SLOTS // ALIGN_BYTES * ALIGN_BYTES)
        if split:
            return w if w >= ALIGN_BYTES else None
        return max(w, ALIGN_BYTES) if scratch_bytes >= ALIGN_BYTES else None

    def run(self, scratch: Any, *, verify: bool = True, gate: Callable[[], None] | None = None,
            idents: dict[int, tuple[int, ...]] | None = None, head: Any = None,
            then: Callable[[Stats], None] | None = None) -> Stats:
        """Read, check and deliver every file. ``scratch`` (``nbytes``, ``u8``) must :meth:`fits`.
        Raises what a read or a check raised (CorruptCheckpoint, StorageError), the protected
        destinations then as they were. ``idents``: the files' identities an earlier run saw
        (another file is refused at open).

        ``head`` (in place; ``scratch`` then just a ring): the windows that fit in it get their
        places there; the later ones are only checked, their protected items listed in
        ``Stats.later`` for ``then(stats)``, called after the gate and before the staged copies
        (what it raises rolls back: :func:`.step.read_step`'s split read)."""
        w = self._window_for(scratch.nbytes, split=head is not None)
        if w is None or head is not None and not self.in_place:  # the callers check fits() first
            raise ValueError(f"scratch of {scratch.nbytes} bytes; this read needs {self.need_bytes()} (a split "
                             f"read: an in-place plan and a ring of {MIN_SLOTS} windows)")
        wins = plan_windows(self.files, w)
        slots = _layout(wins, scratch if head is None else head, w, self.in_place, ROLLBACK_FRACTION, ring=scratch)
        run = _Run(self.files, wins, scratch, w, slots, verify, gate, {} if idents is None else idents, then,
                   split=head is not None)
        self.stats = run.stats
        return run.go()


class _Run:
    """One :meth:`Plan.run`: the window queue shared by the readers, the checker and the copiers."""

    def __init__(self, files: Sequence[FileRead], wins: list[_Win], scratch: Any, w: int, slots: int,
                 verify: bool, gate: Callable[[], None] | None, idents: dict[int, tuple[int, ...]],
                 then: Callable[[Stats], None] | None, *, split: bool):
        self.files, self.wins, self.scratch, self.w, self.verify, self.gate = files, wins, scratch, w, verify, gate
        self.owner: list[int | None] = [None] * slots
        self.idents = idents  # the files' identities at their first open
        self.cond = threading.Condition()
        self.next, self.abort = 0, False
        self.closing = False  # every byte verified: swaps not started yet are staged instead
        self.swapped: list[tuple[int, int, int]] = []  # (caller's bytes, their old bytes in the scratch, length)
        self.deferred: list[tuple[int, int, int]] = []  # (destination, staged bytes, length)
        self.deferred_dev: list[tuple[torch.Tensor, int, int]] = []  # (CUDA destination, staged bytes, length)
        self.stats = Stats(windows=len(wins), bytes_read=sum(x.n for x in wins))
        self.then, self.split = then, split
        devices = {t.device.index for fr in files for t in fr.device.values()}
        self.dev = CudaCopier(scratch, devices) if devices else None

    # -- reader threads ------------------------------------------------------------------------
    def _claim(self) -> _Win | None:
        with self.cond:
            while not self.abort and self.next < len(self.wins):
                x = self.wins[self.next]
                if x.kind != "ring" or self.owner[x.slot] is None:
                    if x.kind == "ring":
                        self.owner[x.slot] = self.next
                        at = x.slot * self.w
                        x.buf = self.scratch.u8[at:at + x.n]
                    self.next += 1
                    return x
                self.cond.wait()
            return None

    def _open(self, fi: int) -> Any:
        f = self.files[fi].open()
        fd = getattr(f, "fd", None)
        st = os.fstat(fd) if isinstance(fd, int) else None  # a write or a rename changes the identity
        now = (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns) if st else getattr(f, "ident", None)  # or an ETag
        if now is not None and self.idents.setdefault(fi, now) != now:
            f.close()
            raise CorruptCheckpoint(f"{self.files[fi].path}: the shard was replaced while it was being read",
                                    path=self.files[fi].path)
        return f

    def _reader(self) -> None:
        opened: dict[int, Any] = {}
        try:
            while (x := self._claim()) is not None:
                try:
                    if x.fi not in opened:
                        opened[x.fi] = self._open(x.fi)
                    assert x.buf is not None
                    opened[x.fi].read([(x.off, _mv(x.buf))])
                except BaseException as exc:  # noqa: BLE001 - raised by the checking thread
                    x.error = exc
                    with self.cond:
                        self.abort = True
                        self.cond.notify_all()
                finally:
                    x.done.set()
        finally:
            for f in opened.values():
                f.close()

    def _release(self, slot: int) -> None:
        with self.cond:
            self.owner[slot] = None
            self.cond.notify_all()

    # -- the copier ----------------------------------------------------------------------------
    def _copies(self, jobs: list[tuple[Any, int, int, bool | None]], slot: int) -> None:
        try:
            with self.cond:
                late = self.closing
                for dst, src, n, swapping in jobs:
                    if swapping and late:  # every byte verified meanwhile: one plain copy after the gate
                        self.deferred.append((dst, src, n))
                        self.stats.deferred_bytes += n
                    elif swapping:
                        self.stats.rollback_bytes += n
            dev: list[Any] = []
            for dst, src, n, swapping in jobs:  # swapping None: a CUDA destination
                if swapping is False:
                    ctypes.memmove(dst, src, n)  # releases the GIL
                elif swapping is None:
                    dev.append((dst, src, n))
                elif not late:
                    swap(dst, src, n, self.swapped)
            if dev:  # returns once the copies are done: the slot may be reused
                self.dev.copy(dev)  # type: ignore[union-attr]  # set when any destination is CUDA
        finally:
            if slot >= 0:
                self._release(slot)

    # -- the checking (caller's) thread --------------------------------------------------------
    def go(self) -> Stats:
        cursors = [ShardCursor(fr.path, fr.header, fr.items, fr.dsts, verify=self.verify, wanted=fr.wanted)
                   for fr in self.files]
        readers = [threading.Thread(target=self._reader, name=f"zerostall-restore-read-{i}", daemon=True)
                   for i in range(min(READERS, len(self.wins)))]
        copier = ThreadPoolExecutor(COPIERS, thread_name_prefix="zerostall-restore-copy")
        copies: list[Any] = []  # the copiers' futures
        ok = False
        try:
            for t in readers:
                t.start()
            for x in self.wins:
                t0 = time.perf_counter()
                x.done.wait()
                self.stats.wait_s += time.perf_counter() - t0
                if x.error is not None:
                    raise x.error
                jobs: list[tuple[Any, int, int, bool | None]] = []
                protect = self.files[x.fi].protect
                assert x.buf is not None
                cursors[x.fi].feed(x.off, _mv(x.buf), x.buf, lambda i, d, s, n: self._route(x, i, d, s, n, protect, jobs),
                                   addr=x.buf.data_ptr())
                if jobs:
                    self.stats.written_bytes += sum(j[2] for j in jobs if not j[3])  # swap False/None
                    copies.append(copier.submit(self._copies, jobs, x.slot if x.kind == "ring" else -1))
                elif x.kind == "ring":
                    self._release(x.slot)
            for fr, cur in zip(self.files, cursors):
                cur.finish(fr.wanted)
            with self.cond:
                self.closing = ADAPTIVE
            copier.shutdown(wait=True)  # every rollback copy is in; its errors surface here
            [f.result() for f in copies]  # a copier's exception fails the load: rolled back below
            if self.gate is not None:  # the ranks' agreement: what it raises rolls back
                self.gate()
            if self.then is not None:  # a split read's second pass: what it raises rolls back too
                self.then(self.stats)
            copy_staged(self.deferred, self.deferred_dev, self.dev)  # the staged part, verified
            ok = True
        finally:
            with self.cond:
                self.abort = self.closing = True  # a failure: queued swaps are skipped, not undone
                self.cond.notify_all()
            for t in readers:
                t.join()
            copier.shutdown(wait=True)
            if self.dev is not None:
                self.dev.sync()  # nothing in flight from the scratch or into a tensor once we return
                self.stats.device_bytes = self.dev.copied
            if not ok:
                rollback(self.swapped)
        return self.stats

    def _route(self, x: _Win, i: int, dst: int, src: int, n: int, protect: set[int],
               jobs: list[tuple[Any, int, int, bool | None]]) -> None:
        dev = self.files[x.fi].device
        if i in protect and (x.kind == "ring" or (self.split and dev and i in dev)):
            # a split read's later window (or a CUDA item: its copies read the scratch only): read again
            self.stats.later.setdefault(x.fi, set()).add(i)
        elif dev and i in dev:  # CUDA memory: the caller's staged until the gate, a new tensor now
            t = dev[i]
            at = dst - t.data_ptr()
            if i in protect:
                self.deferred_dev.append((t[at:at + n], src, n))
                with self.cond:
                    self.stats.deferred_bytes += n
            else:
                jobs.append((t[at:at + n], src, n, None))
        elif x.kind == "stage" and i in protect:
            with self.cond:
                self.deferred.append((dst, src, n))
                self.stats.deferred_bytes += n
        elif i in protect:
            jobs.append((dst, src, n, True))
        else:  # a new tensor (or an unprotected destination): no rollback needed
            jobs.append((dst, src, n, False))


def _mv(u8: torch.Tensor) -> memoryview:
    """A writable memoryview of a flat uint8 CPU tensor's bytes (no copy)."""
    n = u8.numel()
    return memoryview((ctypes.c_ubyte * n).from_address(u8.data_ptr())).cast("B") if n else memoryview(bytearray())


def aligned_empty(nbytes: int) -> torch.Tensor:
    """A flat uint8 tensor of ``align_up(nbytes)`` bytes at a page-aligned address, owned by
    torch's allocator (no huge pages: the fault compacts memory)."""
    padded = align_up(nbytes)
    raw = torch.empty(padded + ALIGN_BYTES, dtype=torch.uint8)
    off = (-raw.data_ptr()) % ALIGN_BYTES
    return raw[off:off + padded]
