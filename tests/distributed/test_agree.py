"""agree_step over a real in-process c10d store (HashStore), one thread per rank."""

import threading

import pytest
from torch.distributed import HashStore

from zerostall.distributed.agree import agree_step
from zerostall.distributed.store import Store
from zerostall.errors import CheckpointNotFound


def _run(cands, history=None):
    raw = HashStore()
    out = [None] * len(cands)

    def rank(r):
        try:
            out[r] = agree_step(Store(raw), "t/a0", r, len(cands), cands[r], timeout_s=30, history=history)
        except CheckpointNotFound as exc:
            out[r] = exc

    ts = [threading.Thread(target=rank, args=(r,)) for r in range(len(cands))]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    assert not raw.check(["t/a0/c/r0"])  # the last reader deleted the round's keys
    return out


def test_newest_common_step():
    assert _run([[1, 2, 3, 5], [1, 2, 4, 5], [2, 3, 5]]) == [5, 5, 5]
    assert _run([[1, 2, 3], [1, 2], [2, 3]]) == [2, 2, 2]


def test_none_common_raises_the_same_error_everywhere():
    out = _run([[3], [2], [1]], history=["step 4 failed on rank 1 (x)"])
    assert all(isinstance(e, CheckpointNotFound) for e in out)
    msgs = {str(e) for e in out}
    assert len(msgs) == 1
    msg = msgs.pop()
    assert "step 4 failed on rank 1 (x)" in msg and "step 3: missing on rank(s) 1, 2" in msg
    assert "step 1: missing on rank(s) 0, 1" in msg


def test_no_steps_anywhere():
    out = _run([[], []])
    assert all(isinstance(e, CheckpointNotFound) and "no rank has a committed step" in str(e) for e in out)


@pytest.mark.parametrize("world", [1, 4])
def test_all_agree_on_identical_sets(world):
    assert _run([[7, 9]] * world) == [9] * world


def test_store_call_bounded_and_reconnects():
    """A request the store never answers (its host stopped) raises StoreTimeout at its bound;
    the next request goes through a new connection (store.clone())."""
    from zerostall.distributed.store import StoreTimeout
    gate = threading.Event()
    clones, answered = [], []

    class Stuck:  # the seam: a connection whose first check never returns until released
        def __init__(self):
            clones.append(self)

        def clone(self):
            return Stuck()

        def check(self, keys):
            if len(clones) == 2:  # the first clone: stuck
                gate.wait(30)
                answered.append(True)
            return True

    s = Store(Stuck())
    with pytest.raises(StoreTimeout, match="did not answer"):
        s.check(["k"], timeout=0.2)
    assert answered == []  # raised at its bound while the request was still unanswered
    assert s.check(["k"], timeout=5) is True and len(clones) == 3  # a fresh connection
    gate.set()
    s.close()
