"""How to fault a fresh staging arena: speed, and how long it holds the GIL.

For each method, maps ``--size-mib`` of fresh anonymous memory, faults all of it from a
background thread, and meanwhile runs a Python "ticker" thread (the training loop's stand-in)
recording the longest gap between its iterations: a method that holds the GIL shows up as a
long gap. Methods:

* ``populate-ctypes``: ``madvise(MADV_POPULATE_WRITE)`` through ctypes, 64 MiB chunks (ours);
* ``populate-python``: ``mmap.madvise(MADV_POPULATE_WRITE)`` on the whole range (holds the GIL);
* ``map-populate``: ``mmap(..., MAP_POPULATE)`` (faults inside mmap(); the hugepage advice can
  only come after, so with THP in ``madvise`` mode it always gets 4 KiB pages);
* ``touch``: ``memset`` through ctypes, 64 MiB chunks;
* ``mlock``: ``mlock`` through ctypes, 64 MiB chunks (needs ``ulimit -l``; skipped otherwise).

each with and without ``MADV_HUGEPAGE``. Usage:
python bench/scripts/prefault.py [--size-mib 1024] [--repeat 3] [--json bench/results/prefault.json]
"""

from __future__ import annotations

import argparse
import ctypes
import json
import mmap
import platform
import resource
import statistics
import threading
import time

libc = ctypes.CDLL(None, use_errno=True)
libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
libc.mlock.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
libc.munlock.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
POPULATE_WRITE = getattr(mmap, "MADV_POPULATE_WRITE", 23)
CHUNK = 64 << 20


def _addr(m: mmap.mmap) -> int:
    return ctypes.addressof(ctypes.c_char.from_buffer(m))


def _chunked(fn, m: mmap.mmap, n: int) -> None:
    a = _addr(m)
    for off in range(0, n, CHUNK):
        if fn(a + off, min(CHUNK, n - off)) not in (0, None):
            raise OSError(ctypes.get_errno(), "fault call failed")


def run(method: str, huge: bool, n: int) -> dict:
    flags = mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS
    if method == "map-populate":
        flags |= getattr(mmap, "MAP_POPULATE", 0x8000)
    gaps: list[float] = []
    stop = threading.Event()

    def ticker() -> None:
        last = time.perf_counter()
        while not stop.is_set():
            now = time.perf_counter()
            gaps.append(now - last)
            last = now
            time.sleep(0.0005)

    tk = threading.Thread(target=ticker)
    tk.start()
    time.sleep(0.05)
    t0 = time.perf_counter()
    err = ""
    holder: list[mmap.mmap] = []

    def fault() -> None:
        nonlocal err
        try:
            m = mmap.mmap(-1, n, flags=flags)
            holder.append(m)
            if huge:
                m.madvise(mmap.MADV_HUGEPAGE)
            if method == "populate-ctypes":
                _chunked(lambda a, k: libc.madvise(ctypes.c_void_p(a), k, POPULATE_WRITE), m, n)
            elif method == "populate-python":
                m.madvise(POPULATE_WRITE)
            elif method == "touch":
                _chunked(lambda a, k: ctypes.memset(a, 0, k) and None, m, n)
            elif method == "mlock":
                _chunked(lambda a, k: libc.mlock(ctypes.c_void_p(a), k), m, n)
        except OSError as exc:
            err = str(exc)

    f = threading.Thread(target=fault)
    f.start()
    f.join()
    t = time.perf_counter() - t0
    stop.set()
    tk.join()
    huge_kib = 0
    if holder:
        m = holder[0]
        if method == "mlock" and not err:
            libc.munlock(ctypes.c_void_p(_addr(m)), n)
        try:
            with open("/proc/self/smaps") as fh:
                a = _addr(m)
                lines = fh.read().split("\n")
            for i, line in enumerate(lines):
                if line.startswith(f"{a:x}-"):
                    for ln in lines[i + 1:i + 30]:
                        if ln.startswith("AnonHugePages:"):
                            huge_kib = int(ln.split()[1])
                            break
                    break
        except OSError:
            pass
        m.close()
    return {"seconds": t, "gbps": n / t / 1e9, "max_ticker_gap_ms": max(gaps) * 1e3 if gaps else 0.0,
            "huge_fraction": huge_kib * 1024 / n, "error": err}


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--size-mib", type=int, default=1024)
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--json", default=None)
    a = p.parse_args()
    n = a.size_mib << 20
    soft, _ = resource.getrlimit(resource.RLIMIT_MEMLOCK)
    methods = ["populate-ctypes", "populate-python", "map-populate", "touch"]
    if soft == resource.RLIM_INFINITY or soft >= n:
        methods.append("mlock")
    rows = []
    for method in methods:
        for huge in (False, True):
            runs = [run(method, huge, n) for _ in range(a.repeat)]
            row = {"method": method, "hugepages": huge,
                   "seconds_median": statistics.median(r["seconds"] for r in runs),
                   "gbps_median": statistics.median(r["gbps"] for r in runs),
                   "gbps_max": max(r["gbps"] for r in runs),
                   "max_ticker_gap_ms": max(r["max_ticker_gap_ms"] for r in runs),
                   "huge_fraction": runs[-1]["huge_fraction"], "error": runs[-1]["error"]}
            rows.append(row)
            print(f"{method:16s} huge={huge!s:5s} {row['gbps_median']:5.2f} GB/s (max {row['gbps_max']:.2f})  "
                  f"ticker max gap {row['max_ticker_gap_ms']:7.1f} ms  THP {row['huge_fraction']:.0%} {row['error']}",
                  flush=True)
    thp = open("/sys/kernel/mm/transparent_hugepage/enabled").read().strip()
    doc = {"size_bytes": n, "repeat": a.repeat, "kernel": platform.release(), "thp": thp,
           "date": time.strftime("%Y-%m-%d %H:%M %Z"), "memlock_soft": soft, "rows": rows}
    if a.json:
        with open(a.json, "w") as f:
            json.dump(doc, f, indent=1)


if __name__ == "__main__":
    main()
