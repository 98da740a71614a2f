"""The RLIMIT_MEMLOCK message: said once per node (local rank 0), at info level when the node
has no swap (the arena stays resident unlocked), with the command that fixes it."""

import logging
import resource

import pytest

from zerostall.memory import arena as zarena

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
