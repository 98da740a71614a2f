"""A cluster on one machine: N nodes, each a Linux network namespace with its own address on a
bridge that lives in a namespace of its own. Used by tests/cluster/ and by the benchmarks; it
imports nothing from zerostall (standard library only), so any script can use it.

    from tests.cluster.harness import Cluster, unavailable

    if (why := unavailable()):             # not root, no `ip netns`, no `tc`: skip with this reason
        ...
    with Cluster(4, rate_mbit=4000) as c:   # nodes n0..n3, 10.a.b.101..104/24, links 4000 mbit each way
        n0 = c.nodes[0]
        p = n0.spawn([sys.executable, "worker.py"], env={"X": "1"})   # a Popen inside n0's namespace
        c.partition([c.nodes[2]])           # n2's link down: alive, cut off from everyone
        c.heal([c.nodes[2]])
        c.partition(c.nodes[2:], together=True)   # n2, n3 reach each other, not the majority
        c.heal()                            # every node back on the one bridge
        c.set_rate(c.nodes[1], 100)         # a slow node (None: no shaping)
        c.stop(c.nodes[1]); c.cont(c.nodes[1]); c.kill(p)   # SIGSTOP/SIGCONT/SIGKILL by PID
        c.wipe(c.nodes[3])                  # its root emptied (kill its processes first)
    # everything is gone here: processes killed, namespaces deleted, loop disks unmounted

Each :class:`Node` has ``name`` (``n<k>``, its ``ZEROSTALL_NODE``), ``addr`` (its 10.x address),
``ns`` (the namespace), ``ifname`` (``eth0`` inside it: ``GLOO_SOCKET_IFNAME``), ``root`` (its
checkpoint root, a directory under the cluster's ``base``) and ``env`` (what :meth:`Node.spawn`
adds to every process: ``ZEROSTALL_NODE``, ``GLOO_SOCKET_IFNAME``, ``NCCL_SOCKET_IFNAME``,
``MASTER_ADDR`` = n0's address). ``Cluster(n, disk_bytes=...)`` gives every node a root of its
own ext4 filesystem of that size (a loop device), so :meth:`Cluster.fill_disk` fills a real
disk; ``Cluster.add_node(name, rate_mbit)`` adds a service node (an S3 server's) on the bridge.
:meth:`Cluster.torchrun` starts one ``torchrun --nnodes=N --rdzv-backend=c10d`` agent per node.

Who calls what: everything runs on the caller's thread; one cluster is not shared between
threads. The host's own interfaces, routes and namespaces are never touched: every link is
created inside the cluster's namespaces (``ip -n``), and deleting them deletes the links.

Cleanup: :meth:`Cluster.close` (a ``with`` block, pytest fixture finalizers and an ``atexit``
hook all call it) kills the cluster's processes (by PID), deletes its namespaces and unmounts
its disks. Names carry the creating process's PID (``zsc<pid>x<k>...``), so parallel runs never
collide, and :func:`cleanup_stale` (run by every new cluster) removes what a dead process of
this harness left behind (SIGKILLed runs) -- never another live process's cluster.
"""

from __future__ import annotations

import atexit
import itertools
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import weakref
from dataclasses import dataclass, field
from typing import Iterable, Sequence

PREFIX = "zsc"
IFNAME = "eth0"
_counter = itertools.count()
_live: "weakref.WeakSet[Cluster]" = weakref.WeakSet()


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run(["ip", *args], capture_output=True, text=True, check=check)


def _sh(argv: Sequence[str], check: bool = True) -> subprocess.CompletedProcess:
    r = subprocess.run(list(argv), capture_output=True, text=True)
    if check and r.returncode != 0:
        raise RuntimeError(f"{' '.join(argv)} failed ({r.returncode}): {r.stderr.strip()}")
    return r


def unavailable() -> str | None:
    """Why a cluster cannot be built here (a skip reason), or None when it can."""
    if os.geteuid() != 0:
        return "the namespace cluster needs root (ip netns, veth, tc)"
    for tool in ("ip", "tc"):
        if shutil.which(tool) is None:
            return f"the namespace cluster needs `{tool}` (iproute2)"
    name = f"{PREFIX}{os.getpid()}probe"
    try:
        r = _ip("netns", "add", name, check=False)
        if r.returncode != 0:
            return f"`ip netns add` fails here: {r.stderr.strip()}"
        r = _ip("-n", name, "link", "add", "zsp0", "type", "veth", "peer", "name", "zsp1", check=False)
        if r.returncode != 0:
            return f"veth pairs cannot be made in a namespace here: {r.stderr.strip()}"
        r = _ip("-n", name, "link", "add", "zsb", "type", "bridge", check=False)
        if r.returncode != 0:
            return f"bridges cannot be made in a namespace here: {r.stderr.strip()}"
    finally:
        _ip("netns", "del", name, check=False)
    return None


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def cleanup_stale() -> list[str]:
    """Delete namespaces (and unmount disks) this harness made in processes that are gone;
    returns what was removed. A live process's cluster is never touched."""
    removed = []
    pat = re.compile(rf"^{PREFIX}(\d+)x\d+")
    for line in _ip("netns", "list", check=False).stdout.splitlines():
        name = line.split()[0] if line.strip() else ""
        m = pat.match(name)
        if m and not _pid_alive(int(m.group(1))):
            _ip("netns", "del", name, check=False)
            removed.append(name)
    with open("/proc/mounts") as f:
        mounts = [ln.split()[1] for ln in f]
    for mnt in mounts:
        m = re.search(rf"/disks/{PREFIX}(\d+)x\d+-[^/]+$", mnt)
        if m and not _pid_alive(int(m.group(1))):
            _sh(["umount", "-l", mnt], check=False)
            removed.append(mnt)
    return removed


@dataclass
class Node:
    """One node of a :class:`Cluster` (module docstring)."""

    name: str
    addr: str
    ns: str
    port: str  # its veth end inside the bridge namespace
    root: str
    cluster: "Cluster" = field(repr=False)
    ifname: str = IFNAME
    procs: list[subprocess.Popen] = field(default_factory=list, repr=False)

    @property
    def env(self) -> dict[str, str]:
        return {"ZEROSTALL_NODE": self.name, "GLOO_SOCKET_IFNAME": self.ifname, "NCCL_SOCKET_IFNAME": self.ifname,
                "MASTER_ADDR": self.cluster.nodes[0].addr if self.cluster.nodes else self.addr}

    def spawn(self, argv: Sequence[str], env: dict[str, str] | None = None, **popen: object) -> subprocess.Popen:
        """Start ``argv`` inside this node's namespace (``ip netns exec``, which execs it: the
        Popen's pid is the process's own), with ``os.environ`` + :attr:`env` + ``env``.
        ``popen``: more :class:`subprocess.Popen` arguments (stdout=, stderr=, cwd=, ...)."""
        full = dict(os.environ, **self.env, **(env or {}))
        p = subprocess.Popen(["ip", "netns", "exec", self.ns, *argv], env=full, **popen)  # type: ignore[arg-type]
        self.procs.append(p)
        return p

    def run(self, argv: Sequence[str], timeout: float = 30) -> subprocess.CompletedProcess:
        """Run a short command in the namespace and wait for it (e.g. ``ss -ltn``)."""
        return subprocess.run(["ip", "netns", "exec", self.ns, *argv], capture_output=True, text=True,
                              timeout=timeout)

    def alive(self) -> list[subprocess.Popen]:
        return [p for p in self.procs if p.poll() is None]


class Cluster:
    """N nodes on one bridge (module docstring). ``rate_mbit``: every node's link rate, each
    way (tc tbf; None: unshaped); ``disk_bytes``: give each node an ext4 root of this size
    (None: a directory under ``base``); ``base``: where roots live (default: a new temp dir,
    removed at close)."""

    def __init__(self, n: int, rate_mbit: float | None = None, *, disk_bytes: int | None = None,
                 base: str | None = None):
        why = unavailable()
        if why:
            raise RuntimeError(why)
        cleanup_stale()
        pid, k = os.getpid(), next(_counter)
        self.tag = f"{PREFIX}{pid}x{k}"
        # the subnet is private to the bridge's namespace (nothing routes it), so it cannot clash
        # with the host's; still distinct per run, which makes logs from parallel runs tell apart
        self.subnet = f"10.{64 + (pid >> 8) % 160}.{(pid + k) % 256}"
        self._own_base = base is None
        self.base = base or tempfile.mkdtemp(prefix=f"{self.tag}-")
        self.disk_bytes = disk_bytes
        self.bridge_ns = f"{self.tag}br"
        self.nodes: list[Node] = []
        self.services: list[Node] = []
        self._disks: list[str] = []
        self._closed = False
        self._next_host = 101  # three digits: addresses sort as the node index (torchrun ranks)
        _live.add(self)
        try:
            _ip("netns", "add", self.bridge_ns)
            for br in ("br0", "br1"):  # br1: the far side of a `together` partition
                _ip("-n", self.bridge_ns, "link", "add", br, "type", "bridge")
                _ip("-n", self.bridge_ns, "link", "set", br, "up")
            for i in range(n):
                self.nodes.append(self._add(f"n{i}", rate_mbit, disk=True))
        except BaseException:
            self.close()
            raise

    # -- building ---------------------------------------------------------------------------
    def _add(self, name: str, rate_mbit: float | None, disk: bool) -> Node:
        host = self._next_host
        if host > 254:
            raise ValueError("a cluster has at most 154 nodes and services")
        self._next_host += 1
        ns, port = f"{self.tag}{name}", f"p{name}"[:15]
        _ip("netns", "add", ns)
        _ip("-n", self.bridge_ns, "link", "add", port, "type", "veth", "peer", "name", IFNAME, "netns", ns)
        _ip("-n", self.bridge_ns, "link", "set", port, "master", "br0", "up")
        addr = f"{self.subnet}.{host}"
        _ip("-n", ns, "addr", "add", f"{addr}/24", "dev", IFNAME)
        _ip("-n", ns, "link", "set", IFNAME, "up")
        _ip("-n", ns, "link", "set", "lo", "up")
        root = os.path.join(self.base, name)
        os.makedirs(root, exist_ok=True)
        if disk and self.disk_bytes:
            self._mount_disk(name, root)
        node = Node(name, addr, ns, port, root, self)
        if rate_mbit:
            self.set_rate(node, rate_mbit)
        return node

    def _mount_disk(self, name: str, root: str) -> None:
        img = os.path.join(self.base, "disks", f"{name}.img")
        os.makedirs(os.path.dirname(img), exist_ok=True)
        with open(img, "wb") as f:
            f.truncate(self.disk_bytes)
        _sh(["mkfs.ext4", "-q", "-F", "-m", "0", img])
        mnt = os.path.join(self.base, "disks", f"{self.tag}-{name}")  # the tag: cleanup_stale finds it
        os.makedirs(mnt, exist_ok=True)
        _sh(["mount", "-o", "loop", img, mnt])  # autoclear: the loop device goes with the umount
        self._disks.append(mnt)
        os.rmdir(root)
        os.symlink(mnt, root)

    def add_node(self, name: str, rate_mbit: float | None = None) -> Node:
        """A service node on the bridge (e.g. ``"s3"``): its own namespace, address and link, a
        directory root, not one of :attr:`nodes` (so not in a job's ``--nnodes``)."""
        node = self._add(name, rate_mbit, disk=False)
        self.services.append(node)
        return node

    def node(self, name: str) -> Node:
        for n in self.nodes + self.services:
            if n.name == name:
                return n
        raise KeyError(f"no node {name!r} in this cluster ({', '.join(n.name for n in self.nodes + self.services)})")

    # -- faults -----------------------------------------------------------------------------
    def partition(self, nodes: Iterable[Node], together: bool = False) -> None:
        """Cut ``nodes`` off: each one's link goes down (alive, reaching no one), or with
        ``together`` they move to a bridge of their own (they reach each other, not the rest)."""
        for nd in nodes:
            if together:
                _ip("-n", self.bridge_ns, "link", "set", nd.port, "master", "br1")
            else:
                _ip("-n", self.bridge_ns, "link", "set", nd.port, "down")

    def heal(self, nodes: Iterable[Node] | None = None) -> None:
        """Undo :meth:`partition` for ``nodes`` (default: every node)."""
        for nd in (self.nodes + self.services) if nodes is None else nodes:
            _ip("-n", self.bridge_ns, "link", "set", nd.port, "master", "br0", "up")

    def set_rate(self, node: Node, mbit: float | None) -> None:
        """Shape ``node``'s link to ``mbit`` megabits/s each way (tbf on both veth ends: the
        bridge side shapes what the node receives, the node side what it sends); None: unshaped."""
        for ns, dev in ((self.bridge_ns, node.port), (node.ns, IFNAME)):
            if mbit:
                # burst: at least 10 ms at the rate (tbf needs rate/HZ), latency bounds the queue
                burst = max(int(mbit * 1e6 / 8 * 0.01), 64 << 10)
                _sh(["tc", "-n", ns, "qdisc", "replace", "dev", dev, "root", "tbf", "rate", f"{mbit}mbit",
                     "burst", str(burst), "latency", "50ms"])
            else:
                _sh(["tc", "-n", ns, "qdisc", "del", "dev", dev, "root"], check=False)

    def _pids(self, target: Node | subprocess.Popen | int) -> list[int]:
        if isinstance(target, Node):
            return [p.pid for p in target.alive()]
        if isinstance(target, subprocess.Popen):
            return [target.pid] if target.poll() is None else []
        return [int(target)]

    def _signal(self, target: Node | subprocess.Popen | int, sig: int) -> None:
        for pid in self._pids(target):
            try:
                os.kill(pid, sig)
            except ProcessLookupError:
                pass

    def stop(self, target: Node | subprocess.Popen | int) -> None:
        """SIGSTOP a process (Popen or pid) or every live process spawned on a node."""
        self._signal(target, signal.SIGSTOP)

    def cont(self, target: Node | subprocess.Popen | int) -> None:
        self._signal(target, signal.SIGCONT)

    def kill(self, target: Node | subprocess.Popen | int) -> None:
        """SIGKILL (after SIGCONT, so a stopped process dies at once) and reap what we spawned."""
        self._signal(target, signal.SIGCONT)
        self._signal(target, signal.SIGKILL)
        procs = target.procs if isinstance(target, Node) else [target] if isinstance(target, subprocess.Popen) else []
        for p in procs:
            try:
                p.wait(10)
            except subprocess.TimeoutExpired:
                pass

    def wipe(self, node: Node) -> None:
        """Empty ``node``'s root (a lost disk replaced by a new one); its processes should be dead."""
        for name in os.listdir(node.root):
            path = os.path.join(node.root, name)
            if os.path.isdir(path) and not os.path.islink(path):
                shutil.rmtree(path)
            else:
                os.unlink(path)

    def fill_disk(self, node: Node, leave_bytes: int = 0) -> int:
        """Fill ``node``'s own filesystem (``disk_bytes=`` clusters) up to ``leave_bytes`` free,
        with a file ``.fill`` in its root; returns the bytes taken. :meth:`unfill` frees them."""
        if not self.disk_bytes:
            raise ValueError("fill_disk needs a cluster made with disk_bytes= (a disk of each node's own)")
        st = os.statvfs(node.root)
        n = max(st.f_bavail * st.f_frsize - leave_bytes, 0)
        path = os.path.join(node.root, ".fill")
        fd = os.open(path, os.O_WRONLY | os.O_CREAT, 0o600)
        try:
            while n > 0:  # fallocate may take less than asked near full: shrink and go on
                try:
                    size = os.fstat(fd).st_size
                    os.posix_fallocate(fd, size, n)
                    break
                except OSError:
                    n //= 2
                    if n < 4096:
                        break
        finally:
            os.close(fd)
        return os.path.getsize(path)

    def unfill(self, node: Node) -> None:
        try:
            os.unlink(os.path.join(node.root, ".fill"))
        except FileNotFoundError:
            pass

    # -- launching ----------------------------------------------------------------------------
    def torchrun_argv(self, k: int, script_argv: Sequence[str], *, port: int = 29400, nproc_per_node: int = 1,
                      nnodes: int | None = None, max_restarts: int = 0, rdzv_id: str = "zsc") -> list[str]:
        """The ``torchrun`` command line of node ``k`` (``nodes[k]``): ``--nnodes=N --node-rank=k
        --rdzv-backend=c10d --rdzv-endpoint=<n0>:<port> --local-addr=<its address>``. n0's agent
        hosts the rendezvous store (``--rdzv-conf=is_host=1``); the rendezvous ranks nodes by their address, and node
        addresses sort as their index (``.101``, ``.102``, ...), so rank r runs on ``nodes[r]``
        (``nproc_per_node`` = 1)."""
        nd = self.nodes[k]
        return [sys.executable, "-m", "torch.distributed.run", f"--nnodes={nnodes or len(self.nodes)}",
                f"--node-rank={k}", f"--nproc-per-node={nproc_per_node}", "--rdzv-backend=c10d",
                f"--rdzv-endpoint={self.nodes[0].addr}:{port}", f"--rdzv-id={rdzv_id}",
                f"--max-restarts={max_restarts}", f"--local-addr={nd.addr}",
                # the agent decides whether it hosts the store by the machine's hostname, which
                # names the host, not the namespace: say so
                f"--rdzv-conf=is_host={int(k == 0)}", *script_argv]

    def torchrun(self, script_argv: Sequence[str], *, port: int = 29400, env: dict[str, str] | None = None,
                 **popen: object) -> list[subprocess.Popen]:
        """One :meth:`torchrun_argv` agent per node, all with the same ``env``; returns them."""
        rid = f"{self.tag}-{time.monotonic_ns()}"
        return [nd.spawn(self.torchrun_argv(k, script_argv, port=port, rdzv_id=rid), env=env, **popen)
                for k, nd in enumerate(self.nodes)]

    # -- ending -------------------------------------------------------------------------------
    def close(self) -> None:
        """Kill every process spawned here (by PID, the whole group torchrun made too), delete
        the namespaces, unmount the disks, remove ``base`` if the cluster made it. Idempotent."""
        if self._closed:
            return
        self._closed = True
        for nd in self.nodes + self.services:
            for p in nd.procs:
                if p.poll() is None:
                    for sig in (signal.SIGCONT, signal.SIGKILL):
                        try:
                            os.kill(p.pid, sig)
                        except ProcessLookupError:
                            pass
                    try:
                        p.wait(10)
                    except subprocess.TimeoutExpired:
                        pass
        # processes a spawned process started (torchrun's workers) die with the namespace's
        # last reference only if they exited; kill whatever still runs inside our namespaces
        for nd in self.nodes + self.services:
            for pid in _ip("netns", "pids", nd.ns, check=False).stdout.split():
                try:
                    os.kill(int(pid), signal.SIGKILL)
                except (ProcessLookupError, ValueError):
                    pass
        for nd in self.nodes + self.services:
            _ip("netns", "del", nd.ns, check=False)
        _ip("netns", "del", self.bridge_ns, check=False)
        for mnt in self._disks:
            _sh(["umount", "-l", mnt], check=False)
        if self._disks:
            shutil.rmtree(os.path.join(self.base, "disks"), ignore_errors=True)
        if self._own_base:
            shutil.rmtree(self.base, ignore_errors=True)

    def __enter__(self) -> "Cluster":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


@atexit.register
def _close_all() -> None:
    for c in list(_live):
        c.close()
