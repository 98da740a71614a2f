"""The coded sender feeds the k + m holders side by side (one thread per fragment, one pacer
for the node): the one-process harness of test_fragments.py (node n0's root, holder servers
n1..n3 on real sockets), RS(2,1)."""

import os
import socket
import threading
import time

import torch

import zerostall
from zerostall.peers import stream

from .test_fragments import NODES, job  # noqa: F401 - the fixture


def _hooked(hook, fn):
    stream.fault_hook = hook
    try:
        return fn()
    finally:
        stream.fault_hook = None


def test_the_holders_are_answered_side_by_side_each_waiting_for_the_others_before_its_ack(job):  # noqa: F811
    """All three holders, each with its fragment fsync'ed and renamed, wait for each other before
    they acknowledge: only a sender that talks to them side by side gets every acknowledgement
    (one that finishes the holders in turn waits for the first one's answer, which never comes
    before the others are there)."""
    job.save(1)
    rep = job.replicator()
    barrier = threading.Barrier(3, timeout=5)

    def hook(p):
        if p == "frag-recv:before-ack":
            barrier.wait()
    ok, failed = _hooked(hook, lambda: job.send(rep, 1))
    assert ok == {0: "n1", 1: "n2", 2: "n3"} and not failed, failed
    assert not barrier.broken


def test_a_holder_that_stops_taking_bytes_is_dropped_alone_and_the_others_finish(job, tmp_path):  # noqa: F811
    """The first holder to reach the middle of its fragment stops reading (until the other two
    hold theirs, at most 30 s): its feed falls behind, is dropped after half of the timeout, and
    the other holders, fed on, keep and acknowledge their fragments (fragments of 24 MiB, small
    receive buffers)."""
    zerostall.save(job.src, {"w": torch.arange(12 << 20, dtype=torch.float32)}, 1)
    for t, _ in job.servers.values():  # accepted connections inherit it: a stopped reader's socket fills up soon
        t._srv.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 256 << 10)
    rep = job.replicator()
    stalled = []
    mu = threading.Lock()

    def others_hold():
        return sum(os.path.exists(job.fragment(n, 1, i)) for i, n in enumerate(NODES[1:])) >= 2

    def hook(p):
        if p != "frag-recv:mid-stream":
            return
        with mu:
            if stalled:
                return
            stalled.append(threading.current_thread().name)
        deadline = time.monotonic() + 30
        while not others_hold() and time.monotonic() < deadline:
            time.sleep(0.05)
    ok, failed = _hooked(hook, lambda: job.send(rep, 1))
    assert stalled and len(ok) == 2 and len(failed) == 1, (ok, failed)
    assert "stopped: still sending stripe" in failed[0], failed
    assert others_hold()
