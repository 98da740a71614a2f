"""The process-wide staging pool: reuse across Checkpointers, background faulting, growth, release."""

import threading

import pytest
import torch

import zerostall
from zerostall import Checkpointer, CheckpointConfig, StagingConfig
from zerostall.memory import arena as arena_mod
from zerostall.saving import pool
from zerostall.memory.ring import BlockRing

pytestmark = pytest.mark.timeout(120)

MiB = 1 << 20


def _cfg(budget=256 * MiB, block=4 * MiB):
    return CheckpointConfig(staging=StagingConfig(budget_bytes=budget, block_bytes=block))


def _state(mib, seed=0):
    g = torch.Generator().manual_seed(seed)
    return {"w": torch.randn(mib * MiB // 4, generator=g), "step": seed}


@pytest.fixture(autouse=True)
def fresh_pool():
    pool.release_now()
    yield
    pool.release_now()


def test_new_checkpointer_and_new_path_reuse_the_arena(tmp_path):
    state = _state(8)
    with Checkpointer(tmp_path / "a", _cfg()) as ck:
        ck.save(1, state).result()
        arena, address, ready = ck.arena, ck.arena.address, ck.arena.ready
    assert pool.current() is not None and pool.current().arena is arena  # lingers for the next user
    with Checkpointer(tmp_path / "b", _cfg()) as ck2:
        ck2.save(1, state).result()
        assert ck2.arena is arena and ck2.arena.address == address
        assert ck2.arena.ready == ready  # nothing faulted again
    assert torch.equal(zerostall.load(tmp_path / "b")["w"], state["w"])


def test_concurrent_checkpointers_share_one_ring(tmp_path):
    states = [_state(12, seed=i) for i in range(3)]
    cks = [Checkpointer(tmp_path / f"c{i}", _cfg(budget=16 * MiB)) for i in range(3)]
    try:
        handles = [ck.save(i, s) for i, (ck, s) in enumerate(zip(cks, states))]
        assert len({id(ck.arena) for ck in cks}) == 1
        for h in handles:
            assert h.result().ok
    finally:
        for ck in cks:
            ck.close()
    for i, s in enumerate(states):
        out = zerostall.load(tmp_path / f"c{i}")
        assert torch.equal(out["w"], s["w"]) and out["step"] == i


def test_first_save_returns_before_the_arena_is_faulted(tmp_path, monkeypatch):
    gate = threading.Event()
    real = arena_mod.populate

    def slow_populate(address, nbytes):  # the seam: the faulter waits until we let it go
        gate.wait(60)
        real(address, nbytes)

    monkeypatch.setattr(arena_mod, "populate", slow_populate)
    cfg = CheckpointConfig(staging=StagingConfig(budget_bytes=64 * MiB, block_bytes=4 * MiB, mlock=False))
    state = _state(16)
    with Checkpointer(tmp_path, cfg) as ck:
        h = ck.save(1, state)
        assert ck.arena.ready == 0 and not h.staged()  # returned; nothing faulted, nothing staged
        assert ck.arena.target > 0
        gate.set()
        assert h.result().ok
        assert ck.arena.ready >= 2 * 4 * MiB
    assert torch.equal(zerostall.load(tmp_path)["w"], state["w"])


def test_prepare_returns_at_once_and_faults_in_the_background(tmp_path, monkeypatch):
    gate = threading.Event()
    real = arena_mod.populate
    monkeypatch.setattr(arena_mod, "populate", lambda a, n: (gate.wait(60), real(a, n)))
    cfg = CheckpointConfig(staging=StagingConfig(budget_bytes=64 * MiB, block_bytes=4 * MiB, mlock=False))
    with Checkpointer(tmp_path, cfg) as ck:
        ck.prepare(_state(8))
        assert ck.arena.ready == 0 and ck.arena.target == ck.ring.capacity_bytes
        gate.set()
        ck.prepare(_state(8), wait=True)
        assert ck.arena.ready == ck.arena.target


def test_arena_grows_when_a_larger_state_arrives(tmp_path):
    with Checkpointer(tmp_path, _cfg(budget=256 * MiB)) as ck:
        ck.save(1, _state(4)).result()
        arena, small = ck.arena, ck.ring.capacity_bytes
        big = _state(40, seed=1)
        ck.save(2, big).result()
        assert ck.arena is arena
        assert ck.ring.capacity_bytes > small
        assert ck.ring.capacity_bytes >= 40 * MiB  # a slot of the larger state
        assert ck.records[-1].arena_bytes == ck.ring.capacity_bytes
    assert torch.equal(zerostall.load(tmp_path)["w"], big["w"])


def test_growth_stays_within_the_budget(tmp_path):
    budget = 32 * MiB
    with Checkpointer(tmp_path, _cfg(budget=budget)) as ck:
        ck.save(1, _state(4)).result()
        ck.save(2, _state(48, seed=2)).result()  # larger than the budget: streams
        assert ck.arena.ready <= budget and ck.ring.capacity_bytes <= budget
        assert ck.arena.nbytes <= budget


def test_one_shot_save_streams_through_a_small_ring_and_reuses_it(tmp_path, monkeypatch):
    monkeypatch.setattr(pool, "ONESHOT_RING_BYTES", 16 * MiB)
    cfg = _cfg(budget=512 * MiB)
    a = _state(40)
    zerostall.save(tmp_path / "one", a, 1, config=cfg)
    p = pool.current()
    assert p is not None and p.ring.capacity_bytes == 16 * MiB and p.arena.ready <= 16 * MiB
    arena = p.arena
    zerostall.save(tmp_path / "two", a, 1, config=cfg)
    assert pool.current().arena is arena  # the loop of one-shot saves reuses the pool
    assert torch.equal(zerostall.load(tmp_path / "two")["w"], a["w"])


def test_pool_is_released_after_its_last_user(tmp_path, monkeypatch):
    monkeypatch.setattr(pool, "LINGER_S", 0.0)
    with Checkpointer(tmp_path / "a", _cfg()) as ck1, Checkpointer(tmp_path / "b", _cfg()) as ck2:
        ck1.save(1, _state(4)).result()
        ck2.save(1, _state(4)).result()
        arena = ck1.arena
    assert pool.current() is None
    assert arena.closed and arena.ready == 0


def test_unused_pool_with_another_budget_is_replaced(tmp_path):
    with Checkpointer(tmp_path / "a", _cfg(budget=64 * MiB)) as ck:
        ck.save(1, _state(4)).result()
        first = ck.arena
    with Checkpointer(tmp_path / "b", _cfg(budget=32 * MiB)) as ck:
        ck.save(1, _state(4)).result()
        assert ck.arena is not first and ck.arena.nbytes <= 32 * MiB
    assert first.closed


def test_load_borrows_the_idle_arena(tmp_path):
    state = _state(8)
    with Checkpointer(tmp_path, _cfg()) as ck:
        ck.save(1, state).result()
        out = ck.load()
        assert torch.equal(out["w"], state["w"])
        ck.save(2, state).result()  # the ring still works after the borrow


def test_ring_releases_out_of_order_ranges():
    r = BlockRing(8 * MiB, MiB)
    r.reserve(10)
    r.release(5, 8)
    assert r.released == 0
    r.release(0, 3)
    assert r.released == 3
    r.release(3, 5)
    assert r.released == 8
    r.release(8, 10)
    assert r.released == 10 and r.idle()
    assert r.resize(16 * MiB) and r.nblocks == 16
    r.reserve(1)
    assert not r.resize(4 * MiB)  # not while a block is in flight


def test_forked_child_builds_its_own_pool(tmp_path):
    import os
    import time
    state = _state(4)
    with Checkpointer(tmp_path / "parent", _cfg()) as ck:
        ck.save(1, state).result()
        parent_pool = pool.current()
        pid = os.fork()
        if pid == 0:  # the child: the parent's snapshot thread does not exist here
            code = 5
            try:
                code = 6 if pool.current() is not None else 0
                if code == 0:
                    zerostall.save(tmp_path / "child", state, 1, config=_cfg())
            except BaseException:  # noqa: BLE001
                code = 7
            os._exit(code)
        deadline = time.monotonic() + 60
        while True:
            done, status = os.waitpid(pid, os.WNOHANG)
            if done:
                break
            if time.monotonic() > deadline:
                os.kill(pid, 9)
                os.waitpid(pid, 0)
                raise AssertionError("the forked child hung saving")
            time.sleep(0.05)
        assert os.waitstatus_to_exitcode(status) == 0
        assert pool.current() is parent_pool
    assert torch.equal(zerostall.load(tmp_path / "child")["w"], state["w"])


def test_growth_beyond_the_reservation_swaps_arenas_between_saves(tmp_path, monkeypatch):
    monkeypatch.setattr(pool, "RESERVE_MIN_BYTES", 16 * MiB)
    with Checkpointer(tmp_path, _cfg(budget=256 * MiB)) as ck:
        small = _state(4)
        ck.save(1, small).result()
        first = ck.arena
        assert first.nbytes == 16 * MiB
        h_small = ck.save(2, small)  # in flight while the larger state arrives
        big = _state(40, seed=1)
        h_big = ck.save(3, big)
        assert h_small.result().ok and h_big.result().ok
        ck.save(4, big).result()
        assert ck.arena is not first and first.closed  # swapped at an idle point, old one unmapped
        assert ck.arena.nbytes >= 80 * MiB and ck.ring.capacity_bytes >= 40 * MiB
    for step, s in ((2, small), (3, big), (4, big)):
        assert torch.equal(zerostall.load(tmp_path, step=step)["w"], s["w"])


def test_a_faulting_failure_fails_the_save_instead_of_hanging(tmp_path, monkeypatch):
    def broken(address, nbytes):
        raise OSError(12, "injected: cannot populate")

    monkeypatch.setattr(arena_mod, "populate", broken)
    cfg = CheckpointConfig(staging=StagingConfig(budget_bytes=64 * MiB, block_bytes=4 * MiB, mlock=False))
    with Checkpointer(tmp_path, cfg, raise_on_background_error=False) as ck:
        exc = ck.save(1, _state(8)).exception(timeout=60)
        assert exc is not None and "cannot populate" in str(exc)
    assert not (tmp_path / "step-1").exists()


def test_a_dropped_checkpointer_gives_back_its_lease_and_root(tmp_path, monkeypatch, caplog):
    """Its threads hold it weakly: once unreachable, the queued save still commits, then the
    lease and the root lock go (before, the persist thread kept it and its lease alive)."""
    import gc
    import weakref

    monkeypatch.setattr(pool, "LINGER_S", 0)
    state = _state(8)
    ck = Checkpointer(tmp_path / "r", _cfg())
    h = ck.save(1, state)
    h.result()
    ck.save(2, state)  # queued; dropped with its Checkpointer (no handle kept)
    ref = weakref.ref(ck)
    p = pool.current()
    del ck, h
    gc.collect()
    assert ref() is None
    done = threading.Event()
    for _ in range(2000):  # the persist thread releases after finishing step 2
        if not p.leases and pool.current() is None:
            done.set()
            break
        threading.Event().wait(0.005)
    assert done.is_set(), "the lease of a dropped Checkpointer was never released"
    assert "dropped without close()" in caplog.text
    with Checkpointer(tmp_path / "r", _cfg(), lock_timeout_s=0) as again:  # the root is free again
        assert again.steps() == [1, 2]
    assert torch.equal(zerostall.load(tmp_path / "r")["w"], state["w"])


def test_a_smaller_budget_never_grows_a_larger_pool_beyond_it(tmp_path):
    """A Checkpointer whose budget is smaller than the live pool's streams its larger state
    through at most its own budget: the pool's faulted memory stays within it (+ nothing)."""
    block = 1 * MiB
    big = Checkpointer(tmp_path / "big", _cfg(budget=64 * MiB, block=block))
    try:
        big.save(1, _state(2)).result()  # the pool: budget 64 MiB, 2 MiB wanted
        assert pool.current().budget == 64 * MiB
        small_budget = 8 * MiB
        state = _state(40, seed=3)
        with Checkpointer(tmp_path / "small", _cfg(budget=small_budget, block=block)) as small:
            small.save(1, state).result()
            p = pool.current()
            assert p.target <= small_budget and p.ring.capacity_bytes <= small_budget
            assert p.arena.ready <= small_budget * 21 // 20  # faulted: its budget + 5% at most
        assert torch.equal(zerostall.load(tmp_path / "small")["w"], state["w"])
    finally:
        big.close()


def test_first_save_cycles_through_the_faulted_prefix_while_the_faulter_lags(tmp_path, monkeypatch):
    """Fresh memory can fault far slower than the disk (a VM's host-discarded pages): the
    first save streams through what is faulted (at least FIRST_LAP_BYTES) instead of
    waiting for the whole target; the next save, once faulted, gets the full ring."""
    monkeypatch.setattr(pool, "FIRST_LAP_BYTES", 8 * MiB)
    monkeypatch.setattr(arena_mod, "FAULT_CHUNK_BYTES", 4 * MiB)
    gate = threading.Event()
    real = arena_mod.populate
    done = [0]

    def lagging_populate(address, nbytes):  # the first 8 MiB fault at once, the rest waits for us
        if done[0] >= 8 * MiB:
            gate.wait(60)
        real(address, nbytes)
        done[0] += nbytes

    monkeypatch.setattr(arena_mod, "populate", lagging_populate)
    cfg = CheckpointConfig(staging=StagingConfig(budget_bytes=128 * MiB, block_bytes=4 * MiB, mlock=False))
    state = _state(48)
    try:
        with Checkpointer(tmp_path, cfg) as ck:
            h = ck.save(1, state)
            assert h.wait(timeout=60), "the first save waited for the whole pool to fault"
            assert not gate.is_set() and ck.arena.ready < ck.arena.target
            assert h.result().arena_bytes == 8 * MiB
            gate.set()
            ck.prepare(state, wait=True)
            assert ck.save(2, state).result().arena_bytes == ck.arena.target >= 48 * MiB
    finally:
        gate.set()
    assert torch.equal(zerostall.load(tmp_path, step=1)["w"], state["w"])
    assert torch.equal(zerostall.load(tmp_path)["w"], state["w"])
