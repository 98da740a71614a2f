"""The root lock belongs to the writer process: a child forked while a Checkpointer is open
never keeps the root locked after the parent's close() or death (issue 23). Real forks."""

import os
import signal
import subprocess
import sys
import threading

import pytest
import torch

import zerostall
from zerostall.errors import RootLockedError, ZerostallError
from zerostall.io import register_engine

from ..engines import FaultyEngine

pytestmark = pytest.mark.timeout(120)


def _holders(root):
    """Every (pid, fd, command line) whose descriptor names the root or its lock file."""
    targets = {os.path.realpath(root), os.path.realpath(os.path.join(root, ".zerostall.lock"))}
    out = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            for fd in os.listdir(f"/proc/{pid}/fd"):
                if os.readlink(f"/proc/{pid}/fd/{fd}") in targets:
                    with open(f"/proc/{pid}/cmdline", "rb") as f:
                        out.append((int(pid), int(fd), f.read().replace(b"\0", b" ")[:200].decode(errors="replace")))
        except OSError:
            continue
    return out


def test_child_forked_while_open_does_not_keep_the_root_locked(ckdir):
    ck = zerostall.Checkpointer(ckdir)
    ck.save(0, {"w": torch.ones(4)}).result()
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child lives on (a dataloader worker, a subprocess helper) until told
        os.close(w)
        os.read(r, 1)
        os._exit(0)
    os.close(r)
    try:
        with pytest.raises(RootLockedError):  # the parent still owns it while open
            zerostall.Checkpointer(ckdir)
        ck.close()
        try:
            again = zerostall.Checkpointer(ckdir)  # was RootLockedError naming our own pid
        except RootLockedError as exc:  # say which processes still hold the lock file or the root
            raise AssertionError(f"{exc}; descriptors on the root: {_holders(ckdir)}") from exc
        again.save(1, {"w": torch.zeros(4)}).result()
        again.close()
    finally:
        os.write(w, b"x")
        os.close(w)
        os.waitpid(pid, 0)
    assert zerostall.load(ckdir)["w"].sum() == 0


def test_child_that_still_holds_a_copy_of_the_lock_descriptor_does_not_keep_it(ckdir):
    """The moment between fork() and the child's at-fork handler, made to last: a child given
    the writer's lock descriptors (``pass_fds``: the same open file descriptions a fork shares)
    keeps them until it exits. (A child forked through libc while this process has other
    threads may wait for a GIL no thread of it holds: not a way to hold the moment open.)"""
    ck = zerostall.Checkpointer(ckdir)
    ck.save(0, {"w": torch.ones(4)}).result()
    lock = ck.tier._lock
    child = subprocess.Popen(["sleep", "120"], pass_fds=[fd for fd in (lock._fd, lock._dfd) if fd is not None])
    try:
        assert any(p == child.pid for p, _, _ in _holders(ckdir))  # the child does hold the lock file open
        ck.close()
        with zerostall.Checkpointer(ckdir) as again:  # was RootLockedError naming our own pid
            again.save(1, {"w": torch.zeros(4)}).result()
    finally:
        child.kill()  # the process we started, by its pid
        child.wait()
    assert zerostall.load(ckdir)["w"].sum() == 0


_PARENT_DIES = r"""
import os, sys, time, torch, zerostall
ck = zerostall.Checkpointer(sys.argv[1])
ck.save(0, {"w": torch.ones(4)}).result()
pid = os.fork()
if pid == 0:
    null = os.open(os.devnull, os.O_RDWR)
    os.dup2(null, 1), os.dup2(null, 2)  # the test reads the parent's output to its end
    time.sleep(90)  # outlives its parent
    os._exit(0)
print(pid, flush=True)
os._exit(0)  # the writer dies without close()
"""


def test_child_outliving_its_dead_parent_does_not_keep_the_root_locked(ckdir):
    out = subprocess.run([sys.executable, "-c", _PARENT_DIES, ckdir], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    child = int(out.stdout.split()[0])
    try:
        os.kill(child, 0)  # still alive
        with zerostall.Checkpointer(ckdir) as ck:  # the kernel dropped the dead writer's lock
            ck.save(1, {"w": torch.zeros(4)}).result()
    finally:
        try:
            os.kill(child, signal.SIGKILL)  # the orphan we made, by its pid
        except ProcessLookupError:
            pass
    assert zerostall.load(ckdir)["w"].sum() == 0


# ---- fork_child_calls: A child forked while a Checkpointer is open and calls it: a clear error, never a hang.
#
# Found by adv2: in the child, ``save()`` accepted the step and its handle never finished (the
# snapshot and persist threads are the parent's), ``load()`` hung for good, and ``wait()`` hung
# on a save the parent had in flight at the fork. Real forks; each child is bounded by alarm().


def _in_child(fn) -> int:
    """Run ``fn`` in a forked child (killed by SIGALRM after 10 s); its exit status."""
    pid = os.fork()
    if pid == 0:
        signal.alarm(10)
        try:
            os._exit(fn())
        except BaseException:  # noqa: BLE001
            os._exit(3)
    _, status = os.waitpid(pid, 0)
    return os.waitstatus_to_exitcode(status)


def _raises_zerostall_error(call) -> int:
    try:
        call()
    except ZerostallError as exc:
        return 0 if "fork" in str(exc) else 4
    return 5


def test_forked_child_save_load_wait_fail_fast(ckdir):
    box, gate = {}, threading.Event()
    register_engine("adv2-forkgate", lambda cfg: box.setdefault("e", FaultyEngine(cfg)))
    ck = zerostall.Checkpointer(ckdir, io=zerostall.IOConfig(engine="adv2-forkgate"))
    try:
        ck.save(1, {"w": torch.ones(8)}).result()
        box["e"].gate = gate
        held = ck.save(2, {"w": torch.zeros(8)})  # in flight while the children run
        assert box["e"].writes_started.wait(30)
        assert _in_child(lambda: _raises_zerostall_error(lambda: ck.save(3, {"w": torch.ones(8)}))) == 0
        assert _in_child(lambda: _raises_zerostall_error(ck.load)) == 0
        assert _in_child(lambda: 0 if ck.wait() else 6) == 0  # the parent's save is not the child's to wait for
        gate.set()
        held.result()
    finally:
        gate.set()
        ck.close()
    assert zerostall.load(ckdir)["w"].sum() == 0
