"""Emulate slow storage: cap the checkpoint device's write bandwidth for this process.

cgroup v1 ``blkio.throttle.write_bps_device`` where the blkio controller is mounted, else
cgroup v2 ``io.max``. The bench process moves into a child cgroup for the duration; the
trainer it spawns is moved back to the root, so only the saver is throttled. Always undone
on exit, Ctrl-C included (a context manager).
"""

from __future__ import annotations

import os
from contextlib import contextmanager
from typing import Iterator

from zerostall.errors import ConfigError

V1 = "/sys/fs/cgroup/blkio"
V2_CANDIDATES = ("/sys/fs/cgroup/unified", "/sys/fs/cgroup")


def disk_of(path: str) -> str:
    st = os.stat(path)
    dev = f"{os.major(st.st_dev)}:{os.minor(st.st_dev)}"
    sys_dir = os.path.realpath(f"/sys/dev/block/{dev}")
    if os.path.exists(os.path.join(sys_dir, "partition")):  # throttle the whole disk
        with open(os.path.join(os.path.dirname(sys_dir), "dev")) as f:
            dev = f.read().strip()
    return dev


def _write(path: str, value: str) -> None:
    with open(path, "w") as f:
        f.write(value)


class Throttle:
    def __init__(self, root: str, cg: str, kind: str):
        self.root, self.cg, self.kind = root, cg, kind

    def exempt(self, pid: int) -> None:
        """Move ``pid`` (e.g. the trainer) back to the unthrottled root cgroup."""
        _write(os.path.join(self.root, "cgroup.procs"), str(pid))


@contextmanager
def throttle_writes(path: str, mbps: int) -> Iterator[Throttle]:
    dev = disk_of(path)
    bps = int(mbps * 1e6)
    name = f"zerostall-bench-{os.getpid()}"
    if os.path.isfile(os.path.join(V1, "blkio.throttle.write_bps_device")):
        root, kind = V1, "v1"
        setting, value = "blkio.throttle.write_bps_device", f"{dev} {bps}"
    else:
        root = next((r for r in V2_CANDIDATES if os.path.isfile(os.path.join(r, "cgroup.controllers"))), "")
        if not root:
            raise ConfigError("--throttle-write-mbps needs cgroup v1 blkio or cgroup v2 io; neither is mounted")
        kind, setting, value = "v2", "io.max", f"{dev} wbps={bps}"
    cg = os.path.join(root, name)
    try:
        os.mkdir(cg)
        if kind == "v2":
            _write(os.path.join(root, "cgroup.subtree_control"), "+io")
        _write(os.path.join(cg, setting), value)
        _write(os.path.join(cg, "cgroup.procs"), str(os.getpid()))
    except OSError as exc:
        try:
            os.rmdir(cg)
        except OSError:
            pass
        raise ConfigError(f"cannot throttle writes to {dev} via cgroup {kind} ({exc}); run as root "
                          "on a host that allows it, or drop --throttle-write-mbps") from None
    try:
        yield Throttle(root, cg, kind)
    finally:
        _write(os.path.join(root, "cgroup.procs"), str(os.getpid()))
        try:
            _write(os.path.join(cg, setting), f"{dev} 0" if kind == "v1" else f"{dev} wbps=max")
        except OSError:
            pass
        try:
            os.rmdir(cg)
        except OSError:
            pass
