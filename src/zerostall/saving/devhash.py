"""A 64-bit content hash computed with torch ops on the tensor's own device.

Used by incremental saves (:mod:`.incremental`) to check CUDA tensors without copying them
to the host: only 8 bytes per tensor cross the bus. Defined on the tensor's raw bytes (so it
is the same on every device and dtype), viewed as little-endian 32-bit words ``w_i`` (the
last 0-3 bytes as single-byte words), in chunks of :data:`CHUNK_WORDS`::

    h_chunk = sum_i w_i * c_i  (mod 2**64)      c_i: fixed pseudo-random odd 64-bit constants
    h = (... (n * K + h_chunk0) * K + h_chunk1 ...) (mod 2**64)        n: byte length, K odd

Every product and sum wraps modulo 2**64 (two's complement int64, as torch computes on the
CPU and on CUDA), so the value does not depend on the order of the reduction. What it
detects: any change of a single word (the ``c_i`` are odd, so ``delta * c_i != 0`` for
``0 < |delta| < 2**32``); for an arbitrary change of several words a collision has
probability about 2**-32 or less, the same order as crc32c's (the constants are fixed, not
secret: this guards against accidents, not adversaries, like crc32c).

Cost: one read of the tensor on the device plus two temporaries of ``8 * CHUNK_WORDS``
bytes (64 MiB) while it runs, and :data:`CHUNK_WORDS` constants (32 MiB) cached per device
for the life of the process. Called from the snapshot thread on the side stream of the
tensor's device (``DeviceStreams.run``); pure torch ops, any thread.
"""

from __future__ import annotations

import threading
from typing import Any

import torch

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
    """:func:`device_hash_async`, read back (synchronises with the tensor's device)."""
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


__all__: list[Any] = ["device_hash", "device_hash_async", "reference_hash", "CHUNK_WORDS"]
