"""Read the kernel's writeback and memory sysctls, and the recommended values; only
:func:`apply_sysctls` (``doctor --apply``) writes.
"""

from __future__ import annotations

import os

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


def _path(name: str) -> str:
    return os.path.join(SYSCTL_DIR, *name.split("."))


def read_sysctls(names: list[str] | None = None) -> dict[str, int | None]:
    out: dict[str, int | None] = {}
    for n in names or list(RECOMMENDED):
        try:
            with open(_path(n)) as f:
                out[n] = int(f.read().split()[0])
        except (OSError, ValueError, IndexError):
            out[n] = None
    return out


def sysctl_d_text() -> str:
    lines = ["# zerostall: deterministic writeback limits for checkpointing hosts",
             "# (install as /etc/sysctl.d/99-zerostall.conf, then: sysctl --system)"]
    # bytes settings after ratios: writing *_bytes zeroes the matching ratio anyway
    for n, (v, why) in RECOMMENDED.items():
        lines.append(f"# {why}")
        lines.append(f"{n} = {v}")
    return "\n".join(lines) + "\n"


def apply_sysctls() -> dict[str, int | None]:
    """Write the recommended values (root); return the previous ones."""
    before = read_sysctls()
    for n, (v, _) in RECOMMENDED.items():
        if not n.endswith("_ratio"):  # writing a *_bytes value zeroes its ratio in the kernel
            with open(_path(n), "w") as f:
                f.write(str(v))
    return before

