"""Attacks on the coded sender's parallel feeds (one thread per fragment): holders that refuse,
never answer or are cut off by close(); no feed thread outlives its coding pass. The one-process
harness of test_fragments.py (n0's root, holder servers n1..n3 on real sockets), RS(2,1)."""

import threading
import time

import pytest
import torch

import zerostall

from zerostall.peers import stream

from .test_coded_send import _hooked
from .test_fragments import job  # noqa: F401 - the fixture

pytestmark = pytest.mark.timeout(120)


def _feeds():
    return [t for t in threading.enumerate() if t.name == "zerostall-peers-fput"]


def test_no_feed_thread_outlives_its_pass_over_many_sends(job):  # noqa: F811
    job.save(1)
    rep = job.replicator()
    ok, failed = job.send(rep, 1)  # what a first send starts for good (the engines' pools) is started
    assert len(ok) == 3 and not failed, failed
    before = sorted(t.name for t in threading.enumerate())
    for _ in range(8):
        ok, failed = job.send(rep, 1)
        assert len(ok) == 3 and not failed, failed
    assert not _feeds()  # joined by the pass itself
    deadline = time.monotonic() + 10  # the holders' connection threads end at the sender's close
    while len(after := sorted(t.name for t in threading.enumerate())) > len(before) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert len(after) <= len(before), (before, after)


def test_a_holder_that_never_answers_fails_alone_within_the_timeout(job):  # noqa: F811
    """n2 keeps its fragment but never acknowledges it (its answer comes after the sender's
    3 s timeout): fragment 1 is not counted as held, the other two are."""
    job.save(1)
    rep = job.replicator()
    gate = threading.Event()
    # a server thread's name does not say which holder it serves: stall the second acknowledgement
    seen = []
    mu = threading.Lock()

    def stall_second(p):
        if p != "frag-recv:before-ack":
            return
        with mu:
            seen.append(p)
            mine = len(seen) == 2
        if mine:
            gate.wait(10)
    try:
        ok, failed = _hooked(stall_second, lambda: job.send(rep, 1))
    finally:
        gate.set()
    assert len(ok) == 2 and len(failed) == 1, (ok, failed)
    assert not _feeds()


def test_a_holder_that_refuses_its_fragment_fails_alone_and_names_the_reason(job):  # noqa: F811
    job.save(1)
    rep = job.replicator()
    seen = []
    mu = threading.Lock()

    def refuse_first(p):
        if p != "frag-recv:before-rename":
            return
        with mu:
            seen.append(p)
            mine = len(seen) == 1
        if mine:
            raise OSError(28, "No space left on device (injected)")
    ok, failed = _hooked(refuse_first, lambda: job.send(rep, 1))
    assert len(ok) == 2 and len(failed) == 1, (ok, failed)
    assert "No space left" in failed[0], failed
    assert not _feeds()


def test_close_during_the_parallel_send_ends_every_feed_and_holds_nothing_unacknowledged(job):  # noqa: F811
    job.save(1)
    rep = job.replicator()
    started = threading.Event()
    release = threading.Event()

    def hold_mid_stream(p):
        if p == "frag-recv:mid-stream":
            started.set()
            release.wait(10)
    out = {}
    stream.fault_hook = hold_mid_stream
    try:
        t = threading.Thread(target=lambda: out.update(r=job.send(rep, 1)))
        t.start()
        assert started.wait(20)
        left = rep.close(0.5)
        release.set()
        t.join(30)
    finally:
        stream.fault_hook = None
        release.set()
    assert not t.is_alive()
    ok, failed = out["r"]
    assert not ok and len(failed) == 3, (ok, failed)
    assert left == []
    assert not _feeds()


def test_a_holder_over_its_quota_is_dropped_alone_and_the_sender_says_why(job):  # noqa: F811
    """n2 has room for nothing: it refuses the fragment as soon as it is announced, while the
    sender is still streaming it; the failure names the holder's quota, not a reset connection."""
    zerostall.save(job.src, {"w": torch.arange(12 << 20, dtype=torch.float32)}, 1)  # fragments of 24 MiB
    job.servers["n2"][1].quota_bytes = 1
    rep = job.replicator()
    ok, failed = job.send(rep, 1)
    assert sorted(ok.values()) == ["n1", "n3"] and len(failed) == 1, (ok, failed)
    assert failed[0].startswith("n2 (fragment 1)") and "quota" in failed[0], failed
