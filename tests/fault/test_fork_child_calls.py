"""A child forked while a Checkpointer is open and calls it: a clear error, never a hang.

Found by adv2: in the child, ``save()`` accepted the step and its handle never finished (the
snapshot and persist threads are the parent's), ``load()`` hung for good, and ``wait()`` hung
on a save the parent had in flight at the fork. Real forks; each child is bounded by alarm()."""

import os
import signal
import threading

import pytest
import torch

import zerostall
from zerostall.errors import ZerostallError
from zerostall.io import register_engine

from ..engines import FaultyEngine

pytestmark = pytest.mark.timeout(120)


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
