"""Coded copies, the restore's decode: the data fragments no live holder serves, rebuilt stripe by
stripe from k fragments that came, checked (:class:`.verify.PieceCheck`) and written with O_DIRECT;
and the rebuild's :class:`Timeline`.

:class:`StripeDecoder` follows the fetch threads (:meth:`~StripeDecoder.advance`,
:meth:`~StripeDecoder.fail`); :meth:`~StripeDecoder.decode` with ``wait=True`` decodes each stripe,
on a thread of its own, once the k fragments it needs are on disk that far, and gives up as soon
as one fails; the rebuild then decodes again after the fetch (``wait=False``).
"""

from __future__ import annotations

import mmap
import os
import threading
import time
from dataclasses import dataclass
from typing import Any

from ..errors import CorruptCheckpoint
from ..io.base import Engine, transfer
from .coding import Code, Layout
from .verify import PieceCheck

__all__ = ["DECODE_BYTES", "Event", "StripeDecoder", "Timeline", "scatter"]
DECODE_BYTES = 16 << 20
"""Bytes of each fragment decoded at a time (the fetch's buffer size)."""


class StripeDecoder:
    """See the module doc. ``checks``: file name -> its :class:`PieceCheck` (fed as source ``i``)."""

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
        """Fragment ``index``'s stream failed: a decode that used it stops."""
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
        """Data fragments ``missing`` from the k fragments ``use``, stripe by stripe: decoded,
        checked, written. ``wait``: each stripe once ``use`` is in that far (False as soon as one
        of them fails); else ``use`` must be complete."""
        lay = self.lay
        code = Code(lay.k, lay.m)
        size = min(lay.fragment_bytes, DECODE_BYTES)
        bufs = {i: mmap.mmap(-1, size) for i in use}
        out = mmap.mmap(-1, size)
        fds: dict[str, int] = {}
        writers: dict[str, Any] = {}

        def fd_of(name: str) -> int:  # opened once a fragment is in that far (a parity's file exists from then)
            if name not in fds:
                fds[name] = os.open(os.path.join(self.part, name), os.O_RDONLY | os.O_CLOEXEC)
            return fds[name]
        try:
            for off, n in lay.stripes(size):
                if wait and not self._ready(use, off + n):
                    return False
                blocks = {i: memoryview(bufs[i])[:n] for i in use}
                for i, mv in blocks.items():
                    if i < lay.k:
                        lay.read(fd_of, i, off, mv)
                    else:
                        transfer(f".fragment-{i}", fd_of(f".fragment-{i}"), off, mv, write=False)
                for i, data in code.recover(blocks, missing).items():
                    omv = memoryview(out)[:n]
                    omv[:] = data
                    scatter(self.engine, lay, self.part, i, off, omv, self.checks, writers)
                    self.timeline.mark("decoded", i, nbytes=n)
                del blocks
            return True
        finally:
            for w in writers.values():
                w.close()
            for fd in fds.values():
                os.close(fd)


def scatter(engine: Engine, lay: Layout, part: str, index: int, off: int, mv: memoryview,
            checks: dict[str, PieceCheck], writers: dict[str, Any]) -> None:
    """Bytes ``mv`` at ``off`` of data fragment ``index``, checked (padding must be zero) and
    written into the node's files in ``part`` (``writers``: name -> open writer; the caller closes them)."""
    for name, foff, at, n in lay.pieces(index, off, len(mv)):
        piece = mv[at - off:at - off + n]
        if name is None:
            if bytes(piece).count(0) != n:
                raise CorruptCheckpoint(f"{part}: non-zero padding in data fragment {index}", path=part)
            continue
        checks[name].feed(index, foff, piece)
        if name not in writers:
            writers[name] = engine.open_update(os.path.join(part, name))
        writers[name].write([(foff, piece)])


@dataclass(frozen=True)
class Event:
    t_s: float
    """Seconds since the timeline began."""
    what: str
    fragment: int = -1
    node: str = ""
    nbytes: int = 0


class Timeline:
    """What a rebuild did when, in order (any thread :meth:`mark`s; read after the rebuild).
    Per fragment stream: ``request``, ``connected``, ``first-byte``, ``set-up``, ``checked``
    (``nbytes`` checked and written), ``last-byte``, ``done`` or ``failed``. Per phase:
    ``decoded`` (a stripe of a missing data fragment), ``synced``, ``committed``."""

    def __init__(self) -> None:
        self.t0 = time.monotonic()
        self.events: list[Event] = []
        self._mu = threading.Lock()

    def mark(self, what: str, fragment: int = -1, node: str = "", nbytes: int = 0) -> None:
        with self._mu:
            self.events.append(Event(time.monotonic() - self.t0, what, fragment, node, nbytes))

    def order(self, *whats: str) -> list[tuple[str, int]]:
        """``(what, fragment)`` of the events named, in order."""
        return [(e.what, e.fragment) for e in self.events if e.what in whats]

    def streams(self) -> list[dict[str, Any]]:
        """One row per fragment stream: seconds to its connection, first and last byte, bytes,
        the rate between first and last byte (``Bps``), how it ended ("done", "failed", "")."""
        rows: dict[tuple[int, str], dict[str, Any]] = {}
        for e in self.events:
            if e.fragment < 0:
                continue
            key = (e.fragment, e.node)
            if e.what == "request":
                rows[key] = {"fragment": e.fragment, "node": e.node, "request_s": e.t_s, "connected_s": None,
                             "first_byte_s": None, "last_byte_s": None, "bytes": 0, "end": ""}
            elif key in rows:
                r = rows[key]
                if e.what in ("connected", "first-byte", "last-byte"):
                    r[e.what.replace("-", "_") + "_s"] = e.t_s
                if e.what == "checked":
                    r["bytes"] += e.nbytes
                elif e.what in ("last-byte", "failed"):  # failed: the bytes received until it stopped
                    r["bytes"] = max(r["bytes"], e.nbytes)
                if e.what in ("done", "failed"):
                    r["end"] = e.what
                    r["end_s"] = e.t_s
        for r in rows.values():
            a, b = r["first_byte_s"], r["last_byte_s"] if r["last_byte_s"] is not None else r.get("end_s")
            r["Bps"] = r["bytes"] / (b - a) if a is not None and b is not None and b > a else 0.0
        return sorted(rows.values(), key=lambda r: r["request_s"])

    def summary(self) -> dict[str, Any]:
        """JSON-able: the streams, and each phase's first and last event (seconds)."""
        phases: dict[str, list[float]] = {}
        for e in self.events:  # in time order
            if e.what in ("checked", "decoded", "synced", "committed"):
                phases.setdefault(e.what, [e.t_s, e.t_s])[1] = e.t_s
        return {"streams": self.streams(), "phases": phases,
                "end_s": self.events[-1].t_s if self.events else 0.0}
