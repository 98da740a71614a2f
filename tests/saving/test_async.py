"""The asynchronous pipeline: save returns at once; the snapshot is what save() saw."""

import errno
import gc
import os
import threading

import pytest
import torch

import zerostall
from zerostall import CheckpointConfig, Checkpointer, IOConfig, StagingConfig
from zerostall.errors import SaveFailed, StorageError
from zerostall.io import register_engine
from zerostall.telemetry.host import read_rss_bytes

from ..engines import FaultyEngine
from ..helpers import clone, equal


def _model_and_opt(seed=0, width=256):
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(width, width), torch.nn.GELU(), torch.nn.Linear(width, 64))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    return model, opt


def _train_step(model, opt, seed):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(32, model[0].in_features, generator=g)
    loss = model(x).pow(2).mean()
    loss.backward()
    opt.step()
    opt.zero_grad()


def test_mutation_after_guard_does_not_change_checkpoint(ckdir):
    model, opt = _model_and_opt()
    _train_step(model, opt, 0)
    with Checkpointer(ckdir) as ck:
        ck.guard(opt)
        state = {"model": model.state_dict(), "optim": opt.state_dict()}
        expected = clone(state)
        h = ck.save(1, state)
        _train_step(model, opt, 1)  # the guard holds opt.step() until the snapshot is staged
        with torch.no_grad():
            for p in model.parameters():
                p.add_(1.0)
        rec = h.result()
    assert rec.ok and rec.bytes > 0 and rec.stall_s <= rec.durable_s  # the caller waited less than the save took
    out = zerostall.load(ckdir)
    assert equal(out, expected)
    assert not equal(out["model"], model.state_dict())


def test_wait_staged_then_mutate(ckdir):
    t = torch.arange(1 << 20, dtype=torch.float32)
    with Checkpointer(ckdir) as ck:
        h = ck.save(1, {"t": t})
        h.wait_staged()
        assert h.staged()
        t.zero_()
        h.result()
    assert zerostall.load(ckdir)["t"][-1].item() == (1 << 20) - 1


def test_state_larger_than_arena_streams_through_ring(ckdir):
    g = torch.Generator().manual_seed(3)
    state = {f"t{i}": torch.randn(25 << 20, generator=g) for i in range(3)}  # 3 x 100 MiB
    state["big"] = torch.randn(10 << 20, generator=g)  # 40 MiB in one tensor
    state["nc"] = torch.randn(2048, 4096, generator=g).t()  # non-contiguous, 32 MiB
    budget = 64 << 20
    cfg = CheckpointConfig(staging=StagingConfig(budget_bytes=budget, block_bytes=4 << 20))
    rss0 = read_rss_bytes()
    with Checkpointer(ckdir, cfg) as ck:
        h = ck.save(1, state)
        rec = h.result()
        assert ck.arena.nbytes <= budget
        assert ck.ring.nblocks * ck.ring.block_bytes <= budget
    assert rec.arena_bytes <= budget and rec.bytes > 300 << 20
    out = zerostall.load(ckdir)
    assert all(torch.equal(out[k], state[k]) for k in state)
    # peak RSS of the save: arena + the one non-contiguous tensor's temporary copy + slack
    assert rec.rss_peak_bytes - rss0 < budget + (32 << 20) + (48 << 20)


@pytest.mark.parametrize("fail", [dict(fail_write=errno.ENOSPC), dict(fail_write=errno.EIO),
                                  dict(fail_sync=errno.EIO)])
def test_background_failure_keeps_training_and_previous(ckdir, fail):
    box = {}
    register_engine("faulty-test", lambda cfg: box.setdefault("e", FaultyEngine(cfg)))
    with Checkpointer(ckdir, io=IOConfig(engine="faulty-test")) as ck:
        ck.save(1, {"x": torch.ones(1 << 16)}).result()
        for k, v in fail.items():
            setattr(box["e"], k, v)
        h = ck.save(2, {"x": torch.zeros(1 << 16)})
        exc = h.exception()
        assert isinstance(exc, StorageError)
        code = fail.get("fail_write", fail.get("fail_sync"))
        assert exc.errno == code and "rank-00000.shard" in str(exc)
        if "fail_sync" in fail:
            assert box["e"].syncs == 2  # one for step 1, one failed for step 2: never retried
        with pytest.raises(SaveFailed, match="step 2") as ei:
            ck.save(3, {"x": torch.zeros(1)})
        assert ei.value.__cause__ is exc
        setattr(box["e"], "fail_write", None)
        setattr(box["e"], "fail_sync", None)
        assert ck.save(4, {"x": torch.full((4,), 4.0)}).result().ok
    assert ck.steps() == [1, 4]
    assert not os.path.exists(os.path.join(ckdir, "step-2.partial"))
    assert zerostall.load(ckdir, step=1)["x"].sum().item() == 1 << 16


def test_background_error_silenced_when_configured(ckdir):
    box = {}
    register_engine("faulty-quiet", lambda cfg: box.setdefault("e", FaultyEngine(cfg, fail_write=errno.EIO)))
    with Checkpointer(ckdir, io=IOConfig(engine="faulty-quiet"), raise_on_background_error=False) as ck:
        h = ck.save(1, {"x": torch.ones(8)})
        h.wait()
        ck.save(2, {"x": torch.ones(8)}).wait()  # no raise
        assert h.exception() is not None
    assert ck.steps() == []


def test_skip_and_block_policies_with_slow_engine(ckdir):
    gate = threading.Event()
    box = {}
    register_engine("gated", lambda cfg: box.setdefault("e", FaultyEngine(cfg, gate=gate)))
    st = StagingConfig(budget_bytes=16 << 20, block_bytes=4 << 20)  # holds ~1 snapshot
    state = {"x": torch.ones(3 << 20 >> 2 << 2)}  # 12 MiB
    with Checkpointer(ckdir, io=IOConfig(engine="gated"), staging=st, backpressure="skip") as ck:
        h1 = ck.save(1, state)
        box["e"].writes_started.wait()
        h2 = ck.save(2, state)  # the disk holds step 1's blocks: no room
        assert h2.skipped and h2.done() and h2.result().skipped and h2.result().interval_steps == 1
        gate.set()
        assert h1.result().ok and h1.result().interval_steps == 0  # the first save
        h3 = ck.save(3, state)
        assert not h3.skipped
        assert h3.result().interval_steps == 2  # the interval the disk allowed: step 2 was skipped
    assert ck.steps() == [1, 3]

    gate.clear()
    box.clear()
    d2 = ckdir + "-block"
    with Checkpointer(d2, io=IOConfig(engine="gated"), staging=st, backpressure="block") as ck:
        h1 = ck.save(1, state)
        box["e"].writes_started.wait()
        h2 = ck.save(2, state)  # accepted; its snapshot waits for ring space
        assert not h2.skipped
        assert not h2.staged()
        gate.set()
        assert h2.wait_staged(timeout=60)
        assert h1.result().ok and h2.result().ok
        assert h2.result().stall_s > 0  # the wait for the ring counts as stall
    assert sorted(os.listdir(d2)).count("step-2") == 1


def test_fifty_saves_no_leaks(ckdir):
    model, opt = _model_and_opt(width=128)
    _train_step(model, opt, 0)
    threads0 = threading.active_count()
    with Checkpointer(ckdir, keep_last=3) as ck:
        ck.guard(opt)
        fds = rss = arena = None
        records = []
        for step in range(50):
            records.append(ck.save(step, {"model": model.state_dict(), "optim": opt.state_dict()}))
            _train_step(model, opt, step + 1)
            if step == 9:
                ck.wait()
                gc.collect()
                fds, rss, arena = len(os.listdir("/proc/self/fd")), read_rss_bytes(), ck.arena.nbytes
        ck.wait()
        gc.collect()
        assert len(os.listdir("/proc/self/fd")) <= fds
        assert ck.arena.nbytes == arena
        assert read_rss_bytes() - rss < 32 << 20
        recs = [h.result() for h in records]
    assert all(r.ok or r.skipped for r in recs)
    assert ck.steps() == [47, 48, 49]  # keep_last=3
    from zerostall.saving import pool
    pool.release_now()  # the process's staging pool (and its threads) would linger a few seconds
    assert threading.active_count() <= threads0 + 1  # io pool threads gone; +1 tolerance for torch
