"""crc32c of tensor bytes where they live, for the content check of incremental saves.

:class:`_CpuCrc`: CPU tensors straight from their memory (no copy), in 16 MiB pieces on a
few threads (crc32c releases the GIL), combined. :class:`_CudaCrc`: CUDA tensors through one
pinned bounce buffer (the path without a device hash, see :mod:`.devhash`). A non-contiguous
tensor is never copied whole (a 256 MiB stride-0 view raised peak RSS by 248 MiB against a
32 MiB staging budget): its bytes, in row-major order, go through one bounce buffer of at
most ``STRIDED_CHUNK_BYTES`` in row slices (:func:`.snapshot.row_slices`), as staging does.
:func:`_file_crc`: bytes on disk (the first save on a base read from disk). Called from the
snapshot thread by :class:`.incremental.RefTracker`.
"""

from __future__ import annotations

import ctypes
import os
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable

import crc32c as _crc
import torch

from ..format.crc_combine import combine
from .snapshot import STRIDED_CHUNK_BYTES, row_slices
from .snapshot import _in_helper_thread

_CRC_PIECE = 16 << 20  # pieces of a tensor checksummed in parallel (then combined)
CRC_THREADS = max(1, min(4, os.cpu_count() or 1))


def _file_crc(path: str, offset: int, n: int) -> int | None:
    """crc32c of ``n`` bytes at ``offset`` of ``path``; None if they cannot all be read."""
    crc = 0
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError:
        return None
    try:
        while n > 0:
            b = os.pread(fd, min(n, _CRC_PIECE), offset)
            if not b:
                return None
            crc = _crc.crc32c(b, crc)
            offset += len(b)
            n -= len(b)
    except OSError:
        return None
    finally:
        os.close(fd)
    return crc


def _crc_at(address: int, n: int) -> int:
    return _crc.crc32c((ctypes.c_char * n).from_address(address)) if n else 0


class _CpuCrc:
    """crc32c of CPU tensors straight from their memory, in pieces on a few threads (crc32c
    releases the GIL; no torch op runs there), combined with :func:`..format.crc_combine.combine`."""

    def __init__(self, threads: int):
        self.pool = ThreadPoolExecutor(max_workers=threads, thread_name_prefix="zerostall-crc") if threads > 1 else None

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
            if self.pool is None:
                jobs.append([(k, _crc_at(a, k)) for a, k in pieces])
            else:
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
        if self.pool is not None:
            self.pool.shutdown(wait=False)


def _strided_crc(t: torch.Tensor, limit: int = STRIDED_CHUNK_BYTES) -> int:
    """crc32c of a non-contiguous CPU tensor's bytes in row-major order (what staging writes),
    through one bounce buffer of at most ``limit`` bytes; the copies are torch ops, run in a
    short-lived helper thread (see :mod:`.snapshot`)."""
    es = t.element_size()
    out: list[int] = []

    def run() -> None:
        buf = torch.empty(min(limit, max(t.numel() * es, es)), dtype=torch.uint8)
        crc = 0
        for sl in row_slices(t, limit):
            n = sl.numel() * es
            if n > buf.numel():  # one innermost row longer than the limit
                buf = torch.empty(n, dtype=torch.uint8)
            buf[:n].view(sl.dtype).view(sl.shape).copy_(sl)
            crc = _crc.crc32c((ctypes.c_char * n).from_address(buf.data_ptr()), crc) if n else crc
        out.append(crc)
    _in_helper_thread(run)
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
        buf = self.buf
        crc = 0
        if not t.is_contiguous():  # row slices, never a whole copy (on the device or the host)
            es = t.element_size()
            for sl in row_slices(t, self.piece):
                k = sl.numel() * es
                if k > buf.numel():
                    buf = self.buf = torch.empty(k, dtype=torch.uint8, pin_memory=True)
                run(t.device, lambda sl=sl, k=k: buf[:k].view(sl.dtype).view(sl.shape).copy_(sl, non_blocking=True))
                crc = _crc.crc32c((ctypes.c_char * k).from_address(buf.data_ptr()), crc) if k else crc
            return crc
        held: list[torch.Tensor] = []
        run(t.device, lambda: held.append(t.reshape(-1).view(torch.uint8)))
        flat = held[0]
        for pos in range(0, flat.numel(), self.piece):
            k = min(self.piece, flat.numel() - pos)
            run(t.device, lambda pos=pos, k=k: buf[:k].copy_(flat[pos:pos + k], non_blocking=True))
            crc = _crc.crc32c((ctypes.c_char * k).from_address(buf.data_ptr()), crc)
        return crc
