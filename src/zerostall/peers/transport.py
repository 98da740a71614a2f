"""The peer transport interface: how committed files move between nodes.

One implementation today, :class:`~.tcp.TcpTransport` (plain TCP, the committed file read
ahead with O_DIRECT and sent, chosen by measurement: see docs/benchmarks.md). An RDMA engine
(NIXL, Mooncake TransferEngine) fits behind the same four calls: it would register the
receiver's aligned buffer and pull or push the file's extents instead of streaming them,
while the handshake, the field checks and the verification (:mod:`.wire`, :mod:`.verify`,
:mod:`.store`) stay as they are.

Who calls what, from which thread:

* ``serve(store)`` once at start-up (caller's thread of ``Checkpointer.__init__``, node
  leaders only): start listening; returns the ``(host, port)`` to publish. Connections are
  served on the transport's own daemon threads.
* ``put``, ``list_held``, ``get`` from the replicator's transfer threads and the restore's
  fetch threads; each call opens its own connection, so a dead or stopped peer fails or
  delays only the calls that involve it, each within ``timeout_s`` of no progress.
* ``close()`` from ``Checkpointer.close()``: stop listening, drop open connections; never
  blocks longer than a socket shutdown.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any, Callable

from ..format.manifest import Manifest
from .store import PeerStore
from .verify import StreamCheck


@dataclass(frozen=True)
class Endpoint:
    """Where a node's peer server listens (published through the c10d store)."""

    node: str
    host: str
    port: int


Sink = Callable[[Manifest, int], tuple[Any, StreamCheck]]
"""``get``'s destination: called with the file's manifest and size once the peer announced
it; returns an open engine writer and the :class:`StreamCheck` to feed."""


class Transport(ABC):
    name: str = "?"

    @abstractmethod
    def serve(self, store: PeerStore) -> tuple[str, int]:
        """Start serving ``store`` (receive puts, answer lists and gets)."""

    @abstractmethod
    def put(self, ep: Endpoint, src: str, step: int, name: str, path: str, man_bytes: bytes) -> str:
        """Copy committed file ``path`` (``name`` of ``src``'s ``step``) to ``ep``; returns the
        receiver's digest once it has verified, fsynced and committed the file."""

    @abstractmethod
    def list_held(self, ep: Endpoint) -> list[dict[str, Any]]:
        """What ``ep`` holds (:meth:`PeerStore.held`)."""

    @abstractmethod
    def get(self, ep: Endpoint, src: str, step: int, name: str, sink: Sink, rng: tuple[int, int] | None = None) -> str:
        """Stream ``name`` of ``src``'s ``step`` from ``ep`` into ``sink``'s writer, checked;
        returns the digest of what was received. ``rng``: only bytes ``[start, end)``, written
        at their offsets (``start`` 0 or a :func:`~.verify.split_points` offset; the sink's
        check covers that range)."""

    @abstractmethod
    def close(self) -> None:
        """Stop serving and abort open transfers (idempotent)."""
