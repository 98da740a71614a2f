"""The disk's direct-I/O line rate, measured with zerostall's own engines (``doctor --probe``,
the bench), on the caller's thread: writes one file in the directory and removes it.
"""

from __future__ import annotations

import contextlib
import os
import time
from pathlib import Path
from typing import Any

from ..config import IOConfig
from ..io import get_engine, probe
from ..memory.arena import Arena


def measure_engine(engine: str, directory: str, size: int, cfg: IOConfig, buf: Arena) -> tuple[float, float]:
    """(write, read) GB/s of ``engine`` for a ``size``-byte file in ``directory`` from ``buf``."""
    eng = get_engine(engine, cfg)
    path = os.path.join(directory, f"zerostall-linerate-{engine}.bin")
    try:
        with eng.open_write(path, size) as f:
            w = _gbps(size, buf, f.write, f.finish)
        with eng.open_read(path) as r:
            return w, _gbps(size, buf, r.read)
    finally:
        Path(path).unlink(missing_ok=True)
        eng.close()


def _gbps(size: int, buf: Arena, io: Any, then: Any = None) -> float:
    """GB/s of ``io`` over ``size`` bytes in ``buf``-sized requests, ``then()`` included."""
    t0 = time.perf_counter()
    for off in range(0, size, buf.nbytes):
        io([(off, buf.mv[:min(buf.nbytes, size - off)])])
    if then is not None:
        then()
    return size / (time.perf_counter() - t0) / 1e9


def line_rate_probe(directory: str, size: int) -> dict[str, float]:
    """O_DIRECT io_uring (or threads where io_uring is unavailable), 4 MiB requests, depth 32:
    {"write_gbps", "read_gbps"}."""
    cfg = IOConfig(chunk_bytes=4 << 20, queue_depth=32, threads=8)
    with contextlib.closing(Arena(min(size, 1 << 30), mlock=False)) as buf:
        w, rd = measure_engine("uring" if probe(directory).io_uring else "threads", directory, size, cfg, buf)
    return {"write_gbps": w, "read_gbps": rd}
