"""close(timeout) that gives up, then close() again: the second call finishes the job.

Found by adv2: the second ``close()`` returned True at once (``_closed`` was set) without
waiting for the work the first one left in flight nor releasing the root lock, the staging
lease and the engine, so the root stayed locked for as long as the object lived."""

import threading

import torch

import zerostall
from zerostall.io import register_engine

from ..engines import FaultyEngine


def test_close_after_a_timed_out_close_waits_and_releases_the_root(ckdir):
    box, gate = {}, threading.Event()
    register_engine("adv2-gated", lambda cfg: box.setdefault("e", FaultyEngine(cfg)))
    ck = zerostall.Checkpointer(ckdir, io=zerostall.IOConfig(engine="adv2-gated"), lock_timeout_s=0)
    ck.save(1, {"x": torch.ones(1 << 16)}).result()
    box["e"].gate = gate  # the next save's write waits for the gate
    h = ck.save(2, {"x": torch.full((1 << 16,), 2.0)})
    assert box["e"].writes_started.wait(30)
    assert ck.close(timeout=0.2) is False  # gives up: the write is held
    gate.set()
    assert ck.close() is True  # waits for step 2, then releases everything
    assert h.done()
    with zerostall.Checkpointer(ckdir, lock_timeout_s=0) as ck2:  # the root is free again
        assert ck2.steps() == [1, 2]
    assert zerostall.load(ckdir)["x"][0].item() == 2.0
