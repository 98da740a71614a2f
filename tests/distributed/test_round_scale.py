"""What a commit round costs the store when it fails at its deadline, and that its bound holds
when the store answers, but slowly (the 512-rank run across namespaces,
``tests/cluster/store_round.py``, found both: with one node cut off, the other 480 ranks each
asked for every rank's report key, one request at a time, twice, and past the deadline each of
those requests got its own late allowance, so the round ended ~80 s after its 10 s deadline).

Threads with one store client each (as real ranks have) on one TCPStore on 127.0.0.1."""

import math
import re
import threading
import time
from collections import Counter

import pytest

from zerostall.distributed import store as store_mod
from zerostall.distributed.commit import commit_round
from zerostall.distributed.session import Session
from zerostall.distributed.store import LATE_CALL_S, Store, StoreTimeout
from zerostall.errors import DistributedError
from zerostall.store.local import LocalTier

from ..helpers import free_port

REPORT = re.compile(r"/s\d+/r\d+$")


class _Counting:
    """A c10d client that counts, per rank, the requests asking about report keys (``r<R>``)."""

    def __init__(self, raw, rank, counts):
        self.raw, self.rank, self.counts = raw, rank, counts

    def clone(self):
        return _Counting(self.raw.clone(), self.rank, self.counts)

    def check(self, keys):
        if any(REPORT.search(k) for k in keys):
            self.counts[self.rank] += 1
        return self.raw.check(keys)

    def __getattr__(self, name):
        return getattr(self.raw, name)


def _frag(r):
    return {"ok": True, "n_tensors": 1, "structure": "",
            "file": {"name": f"rank-{r:05d}.shard", "rank": r, "host": "h", "file_bytes": 8192, "file_id": "x"},
            "tensors": [[0, {"key": "w", "dtype": "float32", "shape": [4], "file": f"rank-{r:05d}.shard",
                             "offset": 4096, "nbytes": 16, "crc32c": r}]],
            "tree": {"d": [[{"v": "w"}, {"T": 0}]]}}


def test_a_missing_rank_costs_the_round_store_requests_linear_in_the_ranks(tmp_path):
    """32 ranks, rank 31 never saves: every other rank fails with one abort naming it, and no
    rank but the coordinator asks about the report keys more than ~2 log2(world) times (each
    asked 2 (world - 1) times before; now the coordinator decides and they read it, or, if it
    is late, each finds the missing ranks by halving)."""
    from torch.distributed import TCPStore
    world, timeout = 32, 1.0
    port = free_port()
    master = TCPStore("127.0.0.1", port, world_size=None, is_master=True, wait_for_workers=False)
    tier = LocalTier(str(tmp_path / "ckpt"), create=True)
    tier.own()
    counts: Counter = Counter()
    outcomes = {}
    # one connection for every rank (the c10d client serialises its requests): each connection
    # made on this VM's loopback may wait 5 s for a reverse DNS lookup
    client = TCPStore("127.0.0.1", port, is_master=False)
    stores = [Store(_Counting(client, r, counts), own_client=False) for r in range(world)]

    def rank_fn(r):
        store = stores[r]
        try:
            session = Session("scale/0", r, world, False, (0,), ("g0",), "g0", members=tuple(range(world)))
            commit_round(store, session, _frag(r), tier, 3, per_rank=True, timeout_s=timeout)
            outcomes[r] = "durable"
        except DistributedError as exc:
            outcomes[r] = (type(exc).__name__, tuple(exc.missing_ranks or ()))
    threads = [threading.Thread(target=rank_fn, args=(r,)) for r in range(world - 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert set(outcomes.values()) == {("DistributedError", (world - 1,))}, outcomes
    most = max((n for r, n in counts.items() if r != 0), default=0)
    assert most <= 3 * math.log2(world), f"a rank asked about the report keys {most} times: {counts}"
    assert not tier.steps()
    del master


def test_past_its_deadline_a_rounds_requests_share_one_late_allowance(tmp_path, monkeypatch):
    """A store that answers every request, each a little late: a loop of requests issued past
    the scope's deadline ends within LATE_CALL_S in all, not LATE_CALL_S per request."""
    from torch.distributed import TCPStore
    port = free_port()
    master = TCPStore("127.0.0.1", port, world_size=None, is_master=True, wait_for_workers=False)
    store = Store(TCPStore("127.0.0.1", port, is_master=False))
    store.set("k", "1")
    each = LATE_CALL_S / 4
    monkeypatch.setattr(store_mod, "fault_hook", lambda what: time.sleep(each))
    answered = 0
    with pytest.raises(StoreTimeout):
        with store.bounded(time.monotonic()):
            for _ in range(40):
                store.check(["k"])
                answered += 1
    assert answered <= LATE_CALL_S / each + 1, f"{answered} requests answered past the deadline"
    store.close()
    del master
