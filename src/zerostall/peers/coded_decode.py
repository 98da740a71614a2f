"""Coded copies, the restore's decode: the data fragments no live holder serves, rebuilt stripe by
stripe from k fragments that came, each decoded stripe checked (:class:`.piececheck.PieceCheck`)
and written with O_DIRECT into the node's files.

:class:`StripeDecoder` follows the fetch threads: they report how far each fragment is in
(:meth:`~StripeDecoder.advance`, after each piece is written), and :meth:`~StripeDecoder.decode`
with ``wait=True`` decodes each stripe as soon as all k fragments it needs are in that far, on
a thread of its own while the streams go on; it gives up (returns False) as soon as one of
them fails, and the rebuild then decodes again after the fetch (``wait=False``) from the k that
did come. The decode reads the k fragments' stripes back from this node's disk (the data
fragments' bytes from the files they were written into, parity from ``.fragment-<i>``
scratch files): a stripe is read once it is written, so the reads overlap the streams too.

Threads: the fetch threads call :meth:`~StripeDecoder.advance`/:meth:`~StripeDecoder.fail`,
the rebuild's caller :meth:`~StripeDecoder.end`; one thread at a time runs :meth:`~StripeDecoder.decode`.
"""

from __future__ import annotations

import mmap
import os
import threading
from typing import Any

from ..errors import CorruptCheckpoint
from ..io.base import Engine
from .coding import Code, Layout
from .piececheck import PieceCheck
from .timeline import Timeline

__all__ = ["DECODE_BYTES", "StripeDecoder"]
DECODE_BYTES = 16 << 20
"""Bytes of each fragment decoded at a time (the fetch's buffer size: a stripe is ready as one
piece of each stream is written)."""


class StripeDecoder:
    """See the module doc. ``checks``: file name -> its :class:`PieceCheck` (the decoded bytes of
    data fragment ``i`` are fed as source ``i``)."""

    def __init__(self, engine: Engine, lay: Layout, part: str, checks: dict[str, PieceCheck], timeline: Timeline):
        self.engine, self.lay, self.part, self.checks, self.timeline = engine, lay, part, checks, timeline
        self._cv = threading.Condition()
        self._progress: dict[int, int] = {}
        self._failed: set[int] = set()
        self._ended = False

    # -- fetch threads, the caller ------------------------------------------------------------
    def advance(self, index: int, nbytes: int) -> None:
        """Fragment ``index``'s first ``nbytes`` are written (checked, where a data fragment)."""
        with self._cv:
            self._progress[index] = nbytes
            self._cv.notify_all()

    def fail(self, index: int) -> None:
        """Fragment ``index``'s stream failed: what it wrote may be wrong, a decode that used it stops."""
        with self._cv:
            self._failed.add(index)
            self._progress.pop(index, None)
            self._cv.notify_all()

    def end(self) -> None:
        """Every fetch is over: a decode waiting for more gives up."""
        with self._cv:
            self._ended = True
            self._cv.notify_all()

    def clean(self, use: list[int]) -> bool:
        """Whether none of ``use`` ever failed (a decode that used them used only what counted)."""
        with self._cv:
            return not any(i in self._failed for i in use)

    # -- the decoding thread ------------------------------------------------------------------
    def _ready(self, use: list[int], upto: int) -> bool:
        with self._cv:
            while not all(self._progress.get(i, 0) >= upto for i in use):
                if self._ended or any(i in self._failed for i in use):
                    return False
                self._cv.wait()
        return True

    def decode(self, use: list[int], missing: list[int], wait: bool) -> bool:
        """Data fragments ``missing`` from fragments ``use`` (k of them), stripe by stripe:
        decoded, checked, written. ``wait``: each stripe as soon as ``use`` is in that far
        (False as soon as one of them fails); else ``use`` must be complete. Raises what the
        checks or the disk raise."""
        lay = self.lay
        code = Code(lay.k, lay.m)
        size = min(lay.fragment_bytes, DECODE_BYTES)
        bufs = {i: mmap.mmap(-1, size) for i in use}
        out = mmap.mmap(-1, size)
        fds: dict[str, int] = {}
        writers: dict[str, Any] = {}
        try:
            for off, n in lay.stripes(size):
                if wait and not self._ready(use, off + n):
                    return False
                blocks = {i: self._read(fds, i, off, n, memoryview(bufs[i])[:n]) for i in use}
                for i, data in code.recover(blocks, missing).items():
                    omv = memoryview(out)[:n]
                    omv[:] = data
                    for name, foff, at, ln in lay.pieces(i, off, n):
                        piece = omv[at - off:at - off + ln]
                        if name is None:
                            if bytes(piece).count(0) != ln:
                                raise CorruptCheckpoint(f"{self.part}: decoded padding of fragment {i} is not zero",
                                                        path=self.part)
                            continue
                        self.checks[name].feed(i, foff, piece)
                        if name not in writers:
                            writers[name] = self.engine.open_update(os.path.join(self.part, name))
                        writers[name].write([(foff, piece)])
                    self.timeline.mark("decoded", i, nbytes=n)
                del blocks
            return True
        finally:
            for w in writers.values():
                w.close()
            for fd in fds.values():
                os.close(fd)

    def _read(self, fds: dict[str, int], i: int, off: int, n: int, mv: memoryview) -> memoryview:
        if i < self.lay.k:
            for name, foff, at, ln in self.lay.pieces(i, off, n):
                dst = mv[at - off:at - off + ln]
                if name is None:
                    dst[:] = bytes(ln)
                else:
                    _pread(self._fd(fds, name), dst, foff)
        else:
            _pread(self._fd(fds, f".fragment-{i}"), mv, off)
        return mv

    def _fd(self, fds: dict[str, int], name: str) -> int:
        """Opened once a fragment is in that far (a parity's scratch file exists only from its first byte)."""
        if name not in fds:
            fds[name] = os.open(os.path.join(self.part, name), os.O_RDONLY | os.O_CLOEXEC)
        return fds[name]


def _pread(fd: int, mv: memoryview, off: int) -> None:
    got = 0
    while got < len(mv):
        r = os.preadv(fd, [mv[got:]], off + got)
        if r <= 0:
            raise CorruptCheckpoint(f"short read at offset {off + got} while decoding")
        got += r
