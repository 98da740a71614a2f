"""What a rebuild from coded fragments did when: one event per state of each fragment's stream
and per phase, so a slow restore can be read (which stream lagged, which phase waited for
which) and its phases' overlap can be tested by the order of events, never by timing.

Events (``what``; ``fragment`` and ``node`` where they belong to one stream)::

    request      a fetch thread asks ``node`` for ``fragment``
    connected    the connection is authenticated, the request about to go out
    first-byte   the holder's reply is in (the manifest, descriptor and fragment follow)
    set-up       the fragment's header block is in, its destination open (the node's files
                 are created and preallocated by the first fragment's set-up)
    checked      a piece of ``nbytes`` fragment bytes checked against the manifest (data
                 fragments: every tensor and padding byte in it) and written
    last-byte    every byte of the fragment in, written (``nbytes``: the fragment's size)
    done         the fragment's own crc32c matched: it counts
    failed       the stream ended early or with a wrong byte (``nbytes``: checked until then)
    decoded      a stripe of a missing data fragment decoded, checked and written
    synced       every file fdatasync'ed
    committed    the step renamed into place

Any thread of one rebuild appends (:meth:`Timeline.mark`); the caller reads it after the
rebuild returned (:meth:`Timeline.streams`, :meth:`Timeline.summary`).
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass
from typing import Any

__all__ = ["Event", "Timeline"]


@dataclass(frozen=True)
class Event:
    t_s: float
    """Seconds since the timeline began."""
    what: str
    fragment: int = -1
    node: str = ""
    nbytes: int = 0


class Timeline:
    """Events of one rebuild, in the order they happened (any thread appends)."""

    def __init__(self) -> None:
        self.t0 = time.monotonic()
        self.events: list[Event] = []
        self._mu = threading.Lock()

    def mark(self, what: str, fragment: int = -1, node: str = "", nbytes: int = 0) -> None:
        with self._mu:
            self.events.append(Event(time.monotonic() - self.t0, what, fragment, node, nbytes))

    def order(self, *whats: str) -> list[tuple[str, int]]:
        """``(what, fragment)`` of the events named, in order (for tests of the phases' overlap)."""
        return [(e.what, e.fragment) for e in self.events if e.what in whats]

    def streams(self) -> list[dict[str, Any]]:
        """One row per fragment stream (a request to a node): seconds from the timeline's start
        to its connection, first and last byte, bytes, the rate between first and last byte
        (bytes/s) and how it ended ("done", "failed" or "" while running)."""
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

    def first(self, what: str) -> float | None:
        return next((e.t_s for e in self.events if e.what == what), None)

    def last(self, what: str) -> float | None:
        return next((e.t_s for e in reversed(self.events) if e.what == what), None)

    def summary(self) -> dict[str, Any]:
        """JSON-able: the streams, and each phase's first and last event (seconds)."""
        phases = {w: [self.first(w), self.last(w)] for w in ("checked", "decoded", "synced", "committed")
                  if self.first(w) is not None}
        return {"streams": self.streams(), "phases": phases,
                "end_s": self.events[-1].t_s if self.events else 0.0}
