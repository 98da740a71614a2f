"""Erasure coding of a node's files for coded peer copies: systematic Reed-Solomon over GF(2^8)
(``zfec``, chosen for releasing the GIL and taking buffers without a copy: docs/peers.md), k data
+ m parity fragments, any k of which rebuild the rest.

The data fragments are plain byte ranges of the node's files of a step, concatenated in
:class:`Layout` order and cut into k pieces of ``fragment_bytes`` (a multiple of 4096, the last
zero-padded): while every data fragment's holder lives nothing is decoded. Parity is computed
per stripe, so coding needs ``(k + m) x STRIPE_BYTES`` of memory. Any thread.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Sequence

from ..config import ALIGN_BYTES
from ..errors import ConfigError, CorruptCheckpoint
from ..io.base import transfer

__all__ = ["Code", "Layout", "STRIPE_BYTES", "require_codec"]

STRIPE_BYTES = 4 << 20
"""Bytes of each fragment coded (and sent) at a time."""
MAX_FRAGMENTS = 64
INSTALL_HINT = "pip install 'zerostall[coded]' (the zfec package)"


def require_codec() -> Any:
    """The zfec module, or a :class:`ConfigError` saying how to install it."""
    try:
        import zfec
    except ImportError as exc:
        raise ConfigError(f"peers.code='rs' needs the zfec erasure-coding library ({exc}); {INSTALL_HINT}") from None
    return zfec


class Code:
    """RS(k, m) (stateless after construction; zfec releases the GIL). ``k`` and ``m`` are checked
    where they enter: :class:`~zerostall.config.PeersConfig` and :meth:`Layout.parse`."""

    def __init__(self, k: int, m: int):
        zfec = require_codec()
        self.k, self.m = k, m
        self._enc = zfec.Encoder(k, k + m)
        self._dec = zfec.Decoder(k, k + m)

    def parity(self, blocks: Sequence[Any]) -> list[bytes]:
        """The m parity blocks of ``blocks`` (k buffers of one length)."""
        return list(self._enc.encode(list(blocks), list(range(self.k, self.k + self.m))))

    def recover(self, blocks: dict[int, Any], missing: Sequence[int]) -> dict[int, bytes]:
        """Data blocks ``missing`` from at least k ``blocks`` (index -> buffer). Garbage in,
        garbage out: callers check each fragment's crc32c first and every tensor's after."""
        if len(blocks) < self.k:
            raise CorruptCheckpoint(f"RS({self.k},{self.m}) needs {self.k} fragments to rebuild, got {len(blocks)}")
        use = sorted(blocks)[:self.k]
        out = self._dec.decode([blocks[i] for i in use], use)
        return {i: bytes(out[i]) for i in missing}


@dataclass(frozen=True)
class Layout:
    """How one node's files of one step map onto k + m fragments. ``files``: ``(name, bytes)`` in
    concatenation order (sizes multiples of 4096)."""

    files: tuple[tuple[str, int], ...]
    k: int
    m: int

    @property
    def total_bytes(self) -> int:
        return sum(n for _, n in self.files)

    @property
    def fragment_bytes(self) -> int:
        per = -(-self.total_bytes // self.k)
        return max(ALIGN_BYTES, -(-per // ALIGN_BYTES) * ALIGN_BYTES)

    def pieces(self, index: int, off: int, n: int) -> Iterator[tuple[str | None, int, int, int]]:
        """Bytes ``[off, off + n)`` of data fragment ``index`` as ``(file name or None for
        padding, offset in that file, offset in the fragment, length)``, in order."""
        if not 0 <= index < self.k or off < 0 or off + n > self.fragment_bytes:
            raise ValueError(f"bytes {off}..{off + n} of data fragment {index} are outside RS({self.k},{self.m})")
        pos = index * self.fragment_bytes + off
        end = pos + n
        base = 0
        for name, size in self.files:
            a, b = max(pos, base), min(end, base + size)
            if a < b:
                yield name, a - base, a - index * self.fragment_bytes, b - a
            base += size
        if end > max(pos, base):
            a = max(pos, base)
            yield None, 0, a - index * self.fragment_bytes, end - a

    def read(self, fd_of: Callable[[str], int], index: int, off: int, mv: memoryview) -> None:
        """Bytes ``[off, off + len(mv))`` of data fragment ``index`` into ``mv``, from the files
        (``fd_of(name)``: an open descriptor) and zeros for the padding."""
        for name, foff, at, n in self.pieces(index, off, len(mv)):
            dst = mv[at - off:at - off + n]
            if name is None:
                dst[:] = bytes(n)
            else:
                transfer(name, fd_of(name), foff, dst, write=False)

    def stripes(self, stripe_bytes: int = STRIPE_BYTES) -> Iterator[tuple[int, int]]:
        """``(offset, length)`` of each stripe of a fragment."""
        f = self.fragment_bytes
        for off in range(0, f, stripe_bytes):
            yield off, min(stripe_bytes, f - off)

    # -- the descriptor every holder keeps beside its fragment -----------------------------
    def describe(self, step: int, checkpoint_id: str, src: str) -> bytes:
        return json.dumps({"format": "zerostall-rs", "version": 1, "code": "rs", "k": self.k, "m": self.m,
                           "step": step, "checkpoint_id": checkpoint_id, "src": src,
                           "fragment_bytes": self.fragment_bytes, "total_bytes": self.total_bytes,
                           "files": [list(f) for f in self.files]}, sort_keys=True).encode()

    @staticmethod
    def parse(raw: bytes, where: str) -> tuple["Layout", dict[str, Any]]:
        """A descriptor written by :meth:`describe`: ``(layout, the document)``, or :class:`CorruptCheckpoint`."""
        try:
            doc = json.loads(raw)
            if doc.get("format") != "zerostall-rs" or doc.get("version") != 1:
                raise ValueError(f"unknown coding descriptor {str(doc)[:120]}")
            files = tuple((str(n), int(s)) for n, s in doc["files"])
            lay = Layout(files, int(doc["k"]), int(doc["m"]))
            if not (1 <= lay.k and 1 <= lay.m and lay.k + lay.m <= MAX_FRAGMENTS) or \
                    any(s < 0 or s % ALIGN_BYTES for _, s in files) or \
                    lay.fragment_bytes != doc["fragment_bytes"] or lay.total_bytes != doc["total_bytes"]:
                raise ValueError("inconsistent sizes")
        except (ValueError, KeyError, TypeError, AttributeError) as exc:
            raise CorruptCheckpoint(f"{where}: bad coding descriptor ({exc})", path=where) from None
        return lay, doc


def descriptor_id(raw: bytes) -> str:
    """A short name of a descriptor's content (fragments go together only under one)."""
    return hashlib.sha256(raw).hexdigest()[:16]
