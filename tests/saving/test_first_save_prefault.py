"""A first save asks the staging pool for the state's tensor bytes before it builds the plan
(100k tensors: ~1 s of plan on this VM, while the faulter thread faults the arena), then for
the plan's exact size. A state the walk cannot take in bulk (an unsupported leaf) asks
nothing early: the plan refuses it with nothing leased."""

import pytest
import torch

import zerostall
from zerostall import Checkpointer
from zerostall.errors import UnsupportedStateError
from zerostall.saving import pool

pytestmark = pytest.mark.timeout(120)


def test_the_pool_faults_while_the_first_plan_is_built(tmp_path, monkeypatch):
    state = {"m": {f"w{i}": torch.full((1000 + i,), float(i)) for i in range(300)}, "step": 3}
    payload = sum(t.numel() * 4 for t in state["m"].values())
    seen = []
    from zerostall.saving import plan_cache
    real = plan_cache.build_plan

    def plan(sd, **kw):
        p = pool.current()
        seen.append(None if p is None else p.arena.target)
        return real(sd, **kw)

    monkeypatch.setattr(plan_cache, "build_plan", plan)
    with Checkpointer(tmp_path / "ck") as ck:
        ck.save(1, state).result()
        ck.save(2, state).result()
        assert seen[0] is not None and seen[0] >= payload  # asked for before the first plan
        assert len(seen) == 1  # the second save reuses the plan
    out = zerostall.load(str(tmp_path / "ck"))
    assert out["step"] == 3 and all(torch.equal(out["m"][k], v) for k, v in state["m"].items())


def test_an_unsupported_state_leases_nothing_early(tmp_path):
    class Odd:
        pass

    with Checkpointer(tmp_path / "ck") as ck:
        with pytest.raises(UnsupportedStateError):
            ck.save(1, {"w": torch.ones(1000), "odd": Odd()})
        assert ck._lease is None or ck._lease.want_bytes == 0  # joined at most: nothing asked for


def test_a_save_walks_the_state_once(tmp_path, monkeypatch):
    from zerostall.saving import plan_cache
    state = {"m": {f"w{i}": torch.full((10,), float(i)) for i in range(40)}, "step": 3}
    tops = []
    real = plan_cache._walk

    def walk(x, *a, **k):
        if x is state:
            tops.append(1)
        return real(x, *a, **k)

    monkeypatch.setattr(plan_cache, "_walk", walk)
    with Checkpointer(tmp_path / "ck") as ck:
        ck.save(1, state).result()  # the first: sizes the pool from the walk, then plans from it
        ck.save(2, state).result()
        assert len(tops) == 2
    assert torch.equal(zerostall.load(str(tmp_path / "ck"))["m"]["w7"], state["m"]["w7"])
