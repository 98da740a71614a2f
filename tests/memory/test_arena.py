"""The staging arena on the host: the background faulter's calls (bounded, covering the range exactly,
sized from the rate) and the warning when pages cannot be locked."""

import logging
import resource

import pytest

import zerostall.memory.arena as A
from zerostall.memory import arena as zarena


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


# ------------------------------------------------------------------------------------------------
# The RLIMIT_MEMLOCK message: said once per node (local rank 0), at info level when the node
# has no swap (the arena stays resident unlocked), with the command that fixes it.

MiB = 1 << 20


@pytest.fixture
def low_memlock():
    """A soft RLIMIT_MEMLOCK below a 4 MiB arena (restored after)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_MEMLOCK)
    if soft == resource.RLIM_INFINITY or soft >= 4 * MiB:
        resource.setrlimit(resource.RLIMIT_MEMLOCK, (MiB, hard))
    yield
    resource.setrlimit(resource.RLIMIT_MEMLOCK, (soft, hard))


def _say(monkeypatch, caplog, env, swap):
    monkeypatch.setattr(zarena, "_warned_memlock", False)
    monkeypatch.setattr(zarena, "swap_total_bytes", lambda: swap)  # the seam: the node's swap
    for var in ("LOCAL_RANK", "SLURM_LOCALID", "OMPI_COMM_WORLD_LOCAL_RANK", "MPI_LOCALRANKID"):
        monkeypatch.delenv(var, raising=False)
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    caplog.clear()
    with caplog.at_level(logging.DEBUG, logger="zerostall"):
        for _ in range(2):  # two arenas in one process: said once
            a = zarena.Arena(4 * MiB, mlock=True, hugepages=False, prefault=False)
            assert not a.locked
            a.close()
    return [(r.levelno, r.getMessage()) for r in caplog.records if "RLIMIT_MEMLOCK" in r.getMessage()]


@pytest.mark.parametrize("env,swap,level", [
    ({}, 0, logging.INFO),                                  # no swap: the budget fits without locking
    ({"LOCAL_RANK": "0"}, 8 << 30, logging.WARNING),        # swap: the arena may be paged out
    ({"LOCAL_RANK": "3"}, 8 << 30, logging.DEBUG),          # not the node's first rank
    ({"SLURM_LOCALID": "1"}, 8 << 30, logging.DEBUG),       # Slurm's local rank
    ({"OMPI_COMM_WORLD_LOCAL_RANK": "0"}, 0, logging.INFO),
])
def test_memlock_message_once_per_node_with_the_fix(low_memlock, monkeypatch, caplog, env, swap, level):
    said = _say(monkeypatch, caplog, env, swap)
    assert len(said) == 1 and said[0][0] == level, said
    assert "fix: " in said[0][1] and ("ulimit -l unlimited" in said[0][1] or "limits.d" in said[0][1])


def test_the_fix_names_root_when_the_hard_limit_is_too_low():
    assert "ulimit -l unlimited" in zarena.memlock_fix(4 * MiB, resource.RLIM_INFINITY)
    assert "ulimit -l unlimited" in zarena.memlock_fix(4 * MiB, 8 * MiB)
    assert "as root" in zarena.memlock_fix(4 * MiB, MiB) and "LimitMEMLOCK" in zarena.memlock_fix(4 * MiB, MiB)
