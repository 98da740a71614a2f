"""``zerostall doctor [PATH]``: what this host and this directory mean for checkpointing, as
:class:`Check` rows (status ``ok``/``warn``/``info``), and the kernel's writeback and memory
sysctls with the recommended values. CLI thread; changes nothing (a probe file is created and
removed) but :func:`apply_sysctls` (``doctor --apply``).
"""

from __future__ import annotations

import contextlib
import os
import resource
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .._util import memlock_fix
from ..io.probe import io_uring_status, probe
from ..memory.host import budget_bytes, host_ram_bytes, local_world_size
from ..telemetry.host import PAGE, read_vmstat
from ..peers.status import doctor_checks

SYSCTL_DIR = "/proc/sys"

RECOMMENDED: dict[str, tuple[int, str]] = {
    "vm.dirty_background_ratio": (0, "0 so that dirty_background_bytes applies: ratios scale with RAM "
                                     "and let a dense node pile up hundreds of GB before writeback starts"),
    "vm.dirty_background_bytes": (1 << 30, "start background writeback at 1 GiB so the disk drains "
                                           "continuously at low saturation"),
    "vm.dirty_ratio": (0, "0 so that dirty_bytes applies: a percentage of 2 TB of RAM is 400 GB of "
                          "unwritten pages before throttling"),
    "vm.dirty_bytes": (4 << 30, "a hard 4 GiB ceiling on dirty data before writers are throttled in "
                                "balance_dirty_pages"),
    "vm.dirty_expire_centisecs": (500, "pages older than 5 s are written back, not 30 s"),
    "vm.dirty_writeback_centisecs": (100, "the flusher wakes every second, flattening spikes"),
    "vm.swappiness": (1, "keep training processes and the staging arena out of swap"),
    "vm.vfs_cache_pressure": (50, "keep dentries/inodes cached under checkpoint memory pressure"),
}


def _path(name: str) -> Path:
    return Path(SYSCTL_DIR, *name.split("."))


def read_sysctls(names: list[str] | None = None) -> dict[str, int | None]:
    out: dict[str, int | None] = {}
    for n in names or list(RECOMMENDED):
        try:
            out[n] = int(_path(n).read_text().split()[0])
        except (OSError, ValueError, IndexError):
            out[n] = None
    return out


def sysctl_d_text() -> str:
    lines = ["# zerostall: deterministic writeback limits for checkpointing hosts",
             "# (install as /etc/sysctl.d/99-zerostall.conf, then: sysctl --system)"]
    # bytes settings after ratios: writing *_bytes zeroes the matching ratio anyway
    for n, (v, why) in RECOMMENDED.items():
        lines += [f"# {why}", f"{n} = {v}"]
    return "\n".join(lines) + "\n"


def apply_sysctls() -> dict[str, int | None]:
    """Write the recommended values (root); return the previous ones."""
    before = read_sysctls()
    for n, (v, _) in RECOMMENDED.items():
        if not n.endswith("_ratio"):  # writing a *_bytes value zeroes its ratio in the kernel
            _path(n).write_text(str(v))
    return before


@dataclass(frozen=True)
class Check:
    name: str
    value: Any
    status: str
    advice: str = ""


def _gib(n: float) -> str:
    return f"{n / 2**30:.1f} GiB"


def host_checks() -> list[Check]:
    ram = host_ram_bytes()
    vm = read_vmstat()
    out = [Check("ram_bytes", ram, "info", _gib(ram)),
           Check("dirty_threshold_bytes", vm.get("nr_dirty_threshold", 0) * PAGE, "info",
                 "writers are throttled in balance_dirty_pages above this"),
           Check("dirty_background_threshold_bytes", vm.get("nr_dirty_background_threshold", 0) * PAGE, "info",
                 "background writeback starts above this")]
    cur = read_sysctls()
    for name, (want, why) in RECOMMENDED.items():
        have = cur.get(name)
        if have is None:
            out.append(Check(name, None, "info", "not readable on this kernel"))
            continue
        pair = name.replace("_ratio", "_bytes")  # a ratio is fine when its *_bytes form meets the target
        ok = have == want or (pair != name and cur.get(pair) == RECOMMENDED[pair][0])
        out.append(Check(name, have, "ok" if ok else "warn", "" if ok else f"recommended {want}: {why}"))
    soft, hard = resource.getrlimit(resource.RLIMIT_MEMLOCK)
    budget = budget_bytes(None, 0.4)
    lockable = soft == resource.RLIM_INFINITY or soft >= budget
    out.append(Check("rlimit_memlock_bytes", "unlimited" if soft == resource.RLIM_INFINITY else soft,
                     "ok" if lockable else "warn", "" if lockable else
                     f"the staging arena ({_gib(budget)}) cannot be mlocked; {memlock_fix(budget, hard)}"))
    thp = ""
    with contextlib.suppress(OSError), open("/sys/kernel/mm/transparent_hugepage/enabled") as f:
        thp = f.read().strip()
    sel = thp[thp.find("[") + 1:thp.find("]")] if "[" in thp else thp
    out.append(Check("transparent_hugepages", sel or "unknown", "ok" if sel in ("always", "madvise") else "info",
                     "" if sel in ("always", "madvise") else "the arena asks for huge pages with MADV_HUGEPAGE"))
    ok, why = io_uring_status()
    out.append(Check("io_uring", why, "ok" if ok else "warn", "" if ok else "the threads engine will be used"))
    out.append(Check("staging_budget_bytes", budget, "ok",
                     f"40% of RAM over {local_world_size()} local rank(s) (ZEROSTALL_BUDGET_FRACTION to change)"))
    return out


def path_checks(path: str) -> list[Check]:
    """Checks of ``path``, or of its nearest existing parent if it does not exist yet (not created)."""
    want = target = os.path.abspath(path)
    while not os.path.isdir(target) and os.path.dirname(target) != target:
        target = os.path.dirname(target)
    pr = probe(target)
    where = pr.path if target == want else f"{want} (does not exist yet; probed {target})"
    out = [Check("path", where, "info"), Check("filesystem", f"{pr.fs_type} on {pr.mount_point}", "info"),
           Check("o_direct", pr.o_direct, "ok" if pr.o_direct else "warn",
                 "" if pr.o_direct else "the bounded buffered engine will be used"),
           Check("statx_dioalign", f"mem {pr.dio_mem_align}, offset {pr.dio_offset_align}" if pr.dio_mem_align
                 else "not reported", "info"),
           Check("engine", pr.engine, "ok" if pr.engine != "buffered" else "warn", pr.reason)]
    fs = pr.fs_type
    if fs.startswith("nfs"):
        out.append(Check("nfs", fs, "warn", "NFS: keep one file per rank (zerostall does), never one shared file "
                         "for all ranks; raise sunrpc slot tables and use nconnect"))
    if fs in ("tmpfs", "ramfs"):
        out.append(Check("tmpfs", fs, "warn", "checkpoints in RAM do not survive a reboot and compete with "
                         "the staging arena for memory"))
    out.extend(Check(*row) for row in doctor_checks(want))
    if fs == "btrfs":
        out.append(Check("btrfs", fs, "warn", "btrfs data checksums make O_DIRECT fall back to buffered "
                         "writes unless the files are nodatasum (chattr +C on the directory)"))
    return out


def probe_line_rate(path: str, size: int = 512 << 20) -> Check:
    from .line_rate import line_rate_probe  # the staging arena (torch): only --probe needs it
    r = line_rate_probe(path, size)
    return Check("line_rate", {k: round(v, 2) for k, v in r.items()}, "info",
                 f"O_DIRECT {size >> 20} MiB, 4 MiB requests, depth 32 (GB/s)")
