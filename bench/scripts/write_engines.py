"""Write 4 GiB from a warm aligned buffer with each engine, and read it back; compare with fio.

Usage: python bench/scripts/write_engines.py [DIR] [--size-gib 4] [--depth 16] [--chunk-mib 8]

Prints GB/s per engine and the ratio to fio's O_DIRECT rate (``--bs=4M --iodepth=32
--ioengine=io_uring``) measured in the same run on the same directory.
"""

from __future__ import annotations

import argparse
import os
import tempfile

from zerostall.tuning.line_rate import measure_engine
from zerostall_bench.hostinfo import _fio
from zerostall.config import IOConfig
from zerostall.memory.arena import Arena


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("dir", nargs="?", default=None)
    p.add_argument("--size-gib", type=float, default=4.0)
    p.add_argument("--depth", type=int, default=IOConfig().queue_depth)
    p.add_argument("--threads", type=int, default=IOConfig().threads)
    p.add_argument("--chunk-mib", type=int, default=IOConfig().chunk_bytes >> 20)
    p.add_argument("--engines", default="uring,threads,buffered")
    a = p.parse_args()
    d = a.dir or tempfile.mkdtemp(prefix="zerostall-engines-", dir=os.getcwd())
    os.makedirs(d, exist_ok=True)
    size = int(a.size_gib * (1 << 30))
    cfg = IOConfig(queue_depth=a.depth, threads=a.threads, chunk_bytes=a.chunk_mib << 20)
    buf = Arena(1 << 30, mlock=False)
    buf.u8[::4096] = 1  # warm
    fio = _fio(d, size)
    print(f"{a.size_gib:g} GiB, chunk {a.chunk_mib} MiB, depth {a.depth}, threads {a.threads}, dir {d}")
    if fio:
        print(f"{'fio':10s} write {fio['write_gbps']:5.2f} GB/s   read {fio['read_gbps']:5.2f} GB/s")
    for e in a.engines.split(","):
        w, r = measure_engine(e, d, size, cfg, buf)
        ratio = f"  ({w / fio['write_gbps']:.0%} / {r / fio['read_gbps']:.0%} of fio)" if fio else ""
        print(f"{e:10s} write {w:5.2f} GB/s   read {r:5.2f} GB/s{ratio}")
    if a.dir is None:
        os.rmdir(d)


if __name__ == "__main__":
    main()
