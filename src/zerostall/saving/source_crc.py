"""The bytes of a tensor where they live, for the content check of incremental saves
(:mod:`.content_check`; snapshot thread, through :class:`.incremental.RefTracker`).

:class:`_CpuCrc`: crc32c of CPU tensors straight from their memory (no copy), in 16 MiB pieces
on a few threads (crc32c releases the GIL), combined. :class:`_CudaCrc`: crc32c of CUDA tensors
through one pinned bounce buffer. A non-contiguous tensor is never copied whole: its bytes, in
row-major order, go through one bounce buffer of at most ``STRIDED_CHUNK_BYTES`` in row slices
(:func:`.snapshot.row_slices`), as staging does. :func:`_file_crc`: bytes on disk (a base read
from disk). :func:`device_hash_async`: a 64-bit hash computed on the tensor's own device.

The device hash is defined on the tensor's raw bytes (the same on every device and dtype),
viewed as little-endian 32-bit words ``w_i`` (the last 0-3 bytes as single-byte words), in
chunks of :data:`CHUNK_WORDS`::

    h_chunk = sum_i w_i * c_i  (mod 2**64)      c_i: fixed pseudo-random odd 64-bit constants
    h = (... (n * K + h_chunk0) * K + h_chunk1 ...) (mod 2**64)        n: byte length, K odd

Every product and sum wraps modulo 2**64, so the value does not depend on the order of the
reduction. It detects any change of a single word (the ``c_i`` are odd); for an arbitrary
change of several words a collision has probability about 2**-32 or less, like crc32c's (the
constants are fixed, not secret: it guards against accidents, not adversaries). Its cost:
docs/incremental.md.
"""

from __future__ import annotations

import ctypes
import os
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable

import crc32c as _crc
import torch

from ..format.crc_combine import combine
from .._util import run_in_fresh_thread
from .snapshot import STRIDED_CHUNK_BYTES, bounce_rows, row_slices

_CRC_PIECE = 16 << 20  # pieces of a tensor checksummed in parallel (then combined)
CRC_THREADS = max(1, min(4, os.cpu_count() or 1))


def _nofollow(path: str, flags: int) -> int:
    """The ``opener`` of a base file: never through a symlink."""
    return os.open(path, flags | os.O_NOFOLLOW)


def _file_crc(path: str, offset: int, n: int) -> int | None:
    """crc32c of ``n`` bytes at ``offset`` of ``path``; None if they cannot all be read."""
    crc = 0
    try:
        with open(path, "rb", buffering=0, opener=_nofollow) as f:
            f.seek(offset)
            while n > 0 and (b := f.read(min(n, _CRC_PIECE))):
                crc = _crc.crc32c(b, crc)
                n -= len(b)
    except OSError:
        return None
    return crc if n == 0 else None


def _crc_at(address: int, n: int, crc: int = 0) -> int:
    """``crc`` extended over ``n`` bytes at ``address``."""
    return _crc.crc32c((ctypes.c_char * n).from_address(address), crc) if n else crc


class _CpuCrc:
    """crc32c of CPU tensors straight from their memory, in pieces on a few threads (crc32c
    releases the GIL; no torch op runs there), combined with :func:`..format.crc_combine.combine`."""

    def __init__(self, threads: int):
        self.pool = ThreadPoolExecutor(max_workers=threads, thread_name_prefix="zerostall-crc")

    def many(self, tensors: list[torch.Tensor]) -> list[int]:
        return self.submit(tensors)()

    def submit(self, tensors: list[torch.Tensor]) -> Callable[[], list[int]]:
        """Start the crc32c of ``tensors`` on the pool; the returned function waits and gives
        them (in order). The tensors must not change until it has returned. Non-contiguous
        ones are checksummed here, slice by slice (:func:`_strided_crc`)."""
        jobs: list[Any] = []  # per tensor: [(piece length, future or crc)]
        for t in tensors:
            n = t.numel() * t.element_size()
            if not t.is_contiguous():
                jobs.append([(n, _strided_crc(t))])
                continue
            base = t.data_ptr()
            first = n - (max(n - 1, 0) // _CRC_PIECE) * _CRC_PIECE  # the odd piece first: the rest combine
            pieces = [(base, first)] + [(base + p, _CRC_PIECE) for p in range(first, n, _CRC_PIECE)]
            jobs.append([(k, self.pool.submit(_crc_at, a, k)) for a, k in pieces])

        def collect() -> list[int]:
            out_crcs = []
            for pieces in jobs:
                crc = 0
                for k, f in pieces:
                    c = f if isinstance(f, int) else f.result()
                    crc = combine(crc, c, k)
                out_crcs.append(crc)
            return out_crcs
        return collect

    def close(self) -> None:
        self.pool.shutdown(wait=False)


def _strided_crc(t: torch.Tensor, limit: int = STRIDED_CHUNK_BYTES) -> int:
    """crc32c of a non-contiguous CPU tensor's bytes in row-major order (what staging writes),
    through :func:`.snapshot.bounce_rows` in a short-lived helper thread."""
    out: list[int] = []

    def run() -> None:
        crc = 0
        for ptr, n in bounce_rows(t, limit):
            crc = _crc_at(ptr, n, crc)
        out.append(crc)
    run_in_fresh_thread(run, "zerostall-copy")
    return out[0]


class _CudaCrc:
    """crc32c of device memory through a pinned bounce buffer. ``run(device, fn)`` runs ``fn``
    on the snapshot thread's side stream of ``device``, after the caller's ``save()`` event
    (so the bytes are those the caller's stream had produced), and waits for it
    (``Snapshotter``/``DeviceStreams.run``)."""

    def __init__(self, piece: int = 16 << 20):
        self.piece = piece
        self.buf: torch.Tensor | None = None

    def __call__(self, t: torch.Tensor, run: Callable[[torch.device, Callable[[], None]], None]) -> int:
        if self.buf is None:
            self.buf = torch.empty(self.piece, dtype=torch.uint8, pin_memory=True)
        buf, crc, es = self.buf, 0, t.element_size()
        for sl in row_slices(t, self.piece):  # never a whole copy (on the device or the host)
            k = sl.numel() * es
            if k > buf.numel():  # one innermost row above the piece
                buf = self.buf = torch.empty(k, dtype=torch.uint8, pin_memory=True)
            run(t.device, lambda sl=sl, k=k: buf[:k].view(sl.dtype).view(sl.shape).copy_(sl, non_blocking=True))
            crc = _crc_at(buf.data_ptr(), k, crc)
        return crc


CHUNK_WORDS = 1 << 22
_K = 0x9E3779B97F4A7C15 - (1 << 64)  # odd, as int64
_SEED = 0x5A5E57A11
_lock = threading.Lock()
_coeffs: dict[str, torch.Tensor] = {}


def _coefficients(device: torch.device, n: int) -> torch.Tensor:
    key = str(device)
    with _lock:
        c = _coeffs.get(key)
        if c is None or c.numel() < n:
            g = torch.Generator().manual_seed(_SEED)
            m = max(n, CHUNK_WORDS)
            host = torch.randint(-(1 << 62), 1 << 62, (m,), generator=g, dtype=torch.int64) * 2 + 1
            c = _coeffs[key] = host.to(device)
        return c


def _chunk_hash(words: torch.Tensor, coeff: torch.Tensor) -> torch.Tensor:
    return (words.to(torch.int64) * coeff[:words.numel()]).sum()


def device_hash_async(t: torch.Tensor) -> torch.Tensor:
    """The hash of a contiguous tensor's bytes as a 0-d int64 tensor on its device (queued
    on the current stream; read it with ``.item()`` after synchronising)."""
    if not t.is_contiguous():
        raise ValueError("device_hash needs a contiguous tensor")
    flat = t.reshape(-1).view(torch.uint8)
    n = flat.numel()
    coeff = _coefficients(t.device, CHUNK_WORDS)
    h = torch.full((), n, dtype=torch.int64, device=t.device)
    n4 = n // 4 * 4
    step = 4 * CHUNK_WORDS
    for pos in range(0, n4, step):
        part = flat[pos:min(pos + step, n4)]
        try:
            words = part.view(torch.int32)
        except RuntimeError:  # storage offset not 4-byte aligned (a bf16 view at an odd index): copy the chunk
            words = part.clone().view(torch.int32)
        h = h * _K + _chunk_hash(words, coeff)
    if n4 < n:
        h = h * _K + _chunk_hash(flat[n4:], coeff)
    return h


def device_hash(t: torch.Tensor) -> int:
    """:func:`device_hash_async`, read back (tests)."""
    return int(device_hash_async(t).item())


def reference_hash(data: bytes, chunk_words: int = CHUNK_WORDS) -> int:
    """The same function in plain Python (tests; small inputs only)."""
    import numpy as np
    mask = (1 << 64) - 1
    c = [int(x) & mask for x in _coefficients(torch.device("cpu"), chunk_words)[:chunk_words].tolist()]
    n = len(data)
    n4 = n // 4 * 4
    words = [int(x) for x in np.frombuffer(data[:n4], dtype="<i4")]
    h = n
    for pos in range(0, len(words), chunk_words):
        s = sum(w * c[i] for i, w in enumerate(words[pos:pos + chunk_words])) & mask
        h = (h * _K + s) & mask
    if n4 < n:
        s = sum(b * c[i] for i, b in enumerate(data[n4:])) & mask
        h = (h * _K + s) & mask
    return h - (1 << 64) if h >= 1 << 63 else h


def clear_cache() -> None:
    """Drop the cached constants (tests)."""
    with _lock:
        _coeffs.clear()
