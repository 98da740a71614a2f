"""Machine facts, the disk's line rate (fio or our own probe) and warm memcpy bandwidth."""

from __future__ import annotations

import json
import os
import platform
import shutil
import subprocess
import time

import torch

from zerostall.io import probe
from zerostall.memory.host import host_ram_bytes
from zerostall.tuning.line_rate import line_rate_probe


def machine(path: str) -> dict[str, object]:
    cpu = platform.processor() or ""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    cpu = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    pr = probe(path)
    dev = ""
    try:
        st = os.stat(path)
        dev = f"{os.major(st.st_dev)}:{os.minor(st.st_dev)}"
        name = os.path.basename(os.path.realpath(f"/sys/dev/block/{dev}"))
        dev = f"{name} ({dev})"
    except OSError:
        pass
    return {"cpu": cpu, "cores": os.cpu_count(), "ram_bytes": host_ram_bytes(),
            "kernel": platform.release(), "fs": pr.fs_type, "device": dev,
            "torch": torch.__version__, "python": platform.python_version()}


def memcpy_gbps(nbytes: int = 256 << 20) -> float:
    a, b = torch.empty(nbytes, dtype=torch.uint8), torch.empty(nbytes, dtype=torch.uint8)
    a.fill_(1)
    b.fill_(2)
    best = float("inf")
    for _ in range(5):
        t0 = time.perf_counter()
        b.copy_(a)
        best = min(best, time.perf_counter() - t0)
    return nbytes / best / 1e9


def _fio(directory: str, size: int) -> dict[str, float] | None:
    if not shutil.which("fio"):
        return None
    out = {}
    for rw, key in (("write", "write_gbps"), ("read", "read_gbps")):
        cmd = ["fio", "--name=zerostall-linerate", f"--directory={directory}", f"--rw={rw}", "--bs=4M",
               "--iodepth=32", "--ioengine=io_uring", "--direct=1", f"--size={size}", "--numjobs=1",
               "--end_fsync=1", "--output-format=json"]
        try:
            res = subprocess.run(cmd, capture_output=True, text=True, timeout=300, check=True)
            job = json.loads(res.stdout)["jobs"][0][rw]
            out[key] = job["bw_bytes"] / 1e9
        except (subprocess.SubprocessError, KeyError, ValueError):
            return None
    for n in os.listdir(directory):
        if n.startswith("zerostall-linerate"):
            os.unlink(os.path.join(directory, n))
    return out


def line_rate(directory: str, size: int = 2 << 30) -> dict[str, object]:
    fio = _fio(directory, size)
    if fio is not None:
        return {**fio, "tool": "fio"}
    return {**line_rate_probe(directory, size), "tool": "probe"}
