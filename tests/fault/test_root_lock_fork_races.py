"""The root lock against forks at the wrong moment: a child that runs no at-fork handler and
releases its copy, and a fork while acquire() has the lock but has not registered it yet.
Either would hand the root to a second writer while the first still writes. Real forks."""

import fcntl
import os
import signal
import subprocess
import sys

import pytest

from zerostall.store.owner import RootLock, StepLock

pytestmark = pytest.mark.timeout(120)


_CHILD_RELEASES = r"""
import ctypes, os, sys
from zerostall.errors import RootLockedError
from zerostall.store.owner import RootLock
lock = RootLock(sys.argv[1])
lock.acquire()
pid = ctypes.PyDLL(None).fork()  # libc's: no Python handler runs; PyDLL keeps the GIL across it
if pid == 0:
    try:
        lock.release()  # a Checkpointer closed or collected in the child
    finally:
        os._exit(0)
os.waitpid(pid, 0)
try:
    RootLock(sys.argv[1]).acquire()
    print("taken by a second writer")
except RootLockedError:
    print("still held")
lock.release()
third = RootLock(sys.argv[1])
third.acquire()  # and the writer's own release does free it
third.release()
print("free")
"""


def _run_alone(script, *args, timeout=60):
    """``script`` in a fresh interpreter of its own session: no other thread of this test
    process holds the GIL or a lock when it forks without handlers; killed whole on a hang."""
    p = subprocess.Popen([sys.executable, "-c", script, *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                         text=True, start_new_session=True)
    try:
        out, err = p.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(p.pid, signal.SIGKILL)  # its session: the process we started and its forks, by pid
        out, err = p.communicate()
        raise AssertionError(f"hung: {out} {err}") from None
    return p.returncode, out, err


def test_a_child_without_the_at_fork_handler_releasing_its_copy_leaves_the_writer_locked(tmp_path):
    """libc's fork runs no Python handler: the child's RootLock still names the shared
    description, and its release() must not unlock the parent's root."""
    rc, out, err = _run_alone(_CHILD_RELEASES, str(tmp_path))
    assert rc == 0, err
    assert out.split("\n")[:2] == ["still held", "free"], out


_ORPHAN = r"""
import os, sys, time

def fork_orphan():  # a child that outlives this process (output to /dev/null); prints its pid
    pid = os.fork()
    if pid == 0:
        null = os.open(os.devnull, os.O_RDWR)
        os.dup2(null, 1), os.dup2(null, 2)
        time.sleep(90)
        os._exit(0)
    print(pid, flush=True)
"""

_FORK_IN_ACQUIRE = _ORPHAN + r"""
from zerostall.store import owner
which, root = sys.argv[1], sys.argv[2]

def fork_now():  # another thread's fork, at the moment the flock is taken but not yet registered
    fork_orphan()

if which == "root":
    record = owner.RootLock._record
    def _record(self, fd):
        fork_now()
        record(self, fd)
    owner.RootLock._record = _record
    held = owner.RootLock(root)  # kept: a collected RootLock releases itself
    held.acquire()
else:
    real = owner.os.ftruncate
    class _Os:  # StepLock writes its holder right after the flock: fork there
        def __getattr__(self, name):
            return getattr(os, name)
        @staticmethod
        def ftruncate(fd, n):
            fork_now()
            return real(fd, n)
    owner.os = _Os()
    held = owner.StepLock(root, 7)
    held.acquire()
os._exit(0)  # the writer dies without release()
"""


@pytest.mark.parametrize("which", ["root", "step"])
def test_a_fork_while_acquire_is_half_way_leaves_no_lock_to_the_child(tmp_path, which):
    root = str(tmp_path)
    env = dict(os.environ)
    out = subprocess.run([sys.executable, "-c", _FORK_IN_ACQUIRE, which, root], capture_output=True,
                         text=True, timeout=60, env=env)
    assert out.returncode == 0, out.stderr
    child = int(out.stdout.split()[0])
    try:
        os.kill(child, 0)  # the child lives on
        if which == "root":
            lock = RootLock(root)
            lock.acquire()  # the writer is dead: the root is free
            lock.release()
        else:
            step = StepLock(root, 7)
            assert step.acquire(wait=False), "the dead writer's child kept the step lock"
            step.release()
    finally:
        try:
            os.kill(child, signal.SIGKILL)  # the orphan we made, by its pid
        except ProcessLookupError:
            pass


_FORK_IN_FETCH = _ORPHAN + r"""
from zerostall.restore.download import fetch_lock
with fetch_lock(sys.argv[1]):  # a download into the root, while another thread forks a helper
    fork_orphan()
    os._exit(0)  # the restoring process dies mid-download
"""


def test_a_child_forked_during_a_download_does_not_keep_the_fetch_lock(tmp_path):
    """Every rank of the node restoring into this root would wait on it for good."""
    root = str(tmp_path)
    out = subprocess.run([sys.executable, "-c", _FORK_IN_FETCH, root], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    child = int(out.stdout.split()[0])
    try:
        os.kill(child, 0)
        fd = os.open(os.path.join(root, ".zerostall.fetch.lock"), os.O_RDWR)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # BlockingIOError: the orphan holds it
        finally:
            os.close(fd)
    finally:
        try:
            os.kill(child, signal.SIGKILL)
        except ProcessLookupError:
            pass
