"""The background faulter's calls: bounded, covering the range exactly, sized from the rate."""

import zerostall.memory.arena as A


def test_fault_calls_cover_the_range_in_bounded_pieces(monkeypatch):
    calls: list[tuple[int, int]] = []
    a = A.Arena(96 << 20, mlock=False, hugepages=False, prefault=False, detached_views=True)
    real = a._fault_once
    monkeypatch.setattr(a, "_fault_once", lambda off, n: (calls.append((off, n)), real(off, n)))
    try:
        a.fault_to(96 << 20)
        a.wait_ready(96 << 20)
        assert a.ready == 96 << 20
        # contiguous, no overlap, nothing left out
        assert calls[0][0] == 0
        assert all(o1 + n1 == o2 for (o1, n1), (o2, _) in zip(calls, calls[1:]))
        assert calls[-1][0] + calls[-1][1] == 96 << 20
        # the first call is one huge page; none is larger than what is published at a time
        assert calls[0][1] == A.FAULT_CALL_MIN_BYTES
        assert max(n for _, n in calls) <= A.FAULT_CHUNK_BYTES
        assert len(calls) >= 2
        a.u8[(96 << 20) - 1] = 7  # faulted memory is usable
        assert int(a.u8[(96 << 20) - 1]) == 7
    finally:
        a.close()


def test_a_slow_call_keeps_the_next_one_small(monkeypatch):
    """Sizing: a call that faulted at 1 MB/s (as a ballooned VM can) leaves the next at the minimum."""
    a = A.Arena(8 << 20, mlock=False, hugepages=False, prefault=False, detached_views=True)
    clock = iter([0.0, 2.0, 10.0, 10.001, 20.0, 20.001, 30.0, 30.001])
    monkeypatch.setattr(A.time, "perf_counter", lambda: next(clock))
    sizes: list[int] = []
    monkeypatch.setattr(a, "_fault_once", lambda off, n: sizes.append(n))
    try:
        a._fault_range(0, 8 << 20)
        assert sizes[:2] == [A.FAULT_CALL_MIN_BYTES, A.FAULT_CALL_MIN_BYTES]  # 2 MiB in 2 s: stay small
        assert sum(sizes) == 8 << 20
    finally:
        a.close()
