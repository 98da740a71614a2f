"""Incremental saves: unchanged tensors are referenced, not rewritten; every step still loads
bit-exact, verifies, survives retention, and a damaged referenced file fails its dependents."""

import json
import os

import numpy as np
import pytest
import torch

import zerostall
from zerostall.cli import main as cli
from zerostall.config import IOConfig
from zerostall.errors import CheckpointExistsError, ConfigError, CorruptCheckpoint
from zerostall.io import get_engine
from zerostall.restore import verify_step
from zerostall.store.local import LocalTier
from zerostall.store.retention import doomed, prune
from tests.helpers import flip_byte

from ..helpers import clone, equal

pytestmark = pytest.mark.timeout(120)


def _model():
    torch.manual_seed(0)
    m = torch.nn.Sequential(torch.nn.Embedding(512, 64), torch.nn.Linear(64, 256), torch.nn.GELU(),
                            torch.nn.Linear(256, 64), torch.nn.Linear(64, 8))
    for p in list(m.parameters())[:-2]:  # a frozen base; the head trains
        p.requires_grad_(False)
    return m


def _train(m, opt, step):
    x = torch.randint(0, 512, (16, 4), generator=torch.Generator().manual_seed(step))
    m(x).pow(2).mean().backward()
    opt.step()
    opt.zero_grad()


def _state(m, opt, step):
    return {"model": m.state_dict(), "optim": opt.state_dict(), "step": step}


def _verify_all(ckdir):
    tier = LocalTier(ckdir)
    eng = get_engine("threads", IOConfig())
    try:
        return [verify_step(tier, s, eng) for s in tier.steps()]
    finally:
        eng.close()


@pytest.mark.parametrize("mode", [True, "version"])
def test_round_trip_bit_exact_and_bytes(ckdir, mode):
    m = _model()
    opt = torch.optim.AdamW([p for p in m.parameters() if p.requires_grad], lr=1e-2)
    expect, records = {}, []
    with zerostall.Checkpointer(ckdir, incremental=mode, full_every=4) as ck:
        for step in range(6):
            _train(m, opt, step)
            records.append(ck.save(step, _state(m, opt, step)).result())
            expect[step] = clone(_state(m, opt, step))
    full = records[0]
    assert full.bytes_referenced == 0 and full.bytes_written == full.bytes
    incr = records[1]
    frozen = sum(p.numel() * 4 for p in m.parameters() if not p.requires_grad)
    assert incr.bytes_referenced == frozen
    assert incr.bytes_written < full.bytes_written * 0.2
    assert records[4].bytes_referenced == 0  # full_every=4: the 5th save is full again
    for step, want in expect.items():
        got = zerostall.load(ckdir, step=step)
        assert equal(got, want), step
    mans = _verify_all(ckdir)
    assert [bool(mm.ref_files) for mm in mans] == [False, True, True, True, False, True]
    assert {r.step for r in mans[5].ref_files} == {4}
    assert mans[1].format_version == mans[0].format_version == 3  # version 3 with and without ref_files


def test_in_place_writes_that_bypass_the_version_counter_are_caught(ckdir):
    base = torch.randn(1 << 16)
    arr = np.arange(4096, dtype=np.float32)
    state = {"base": base, "arr": arr, "view": base[:100]}
    with zerostall.Checkpointer(ckdir, incremental=True) as ck:
        r0 = ck.save(0, state).result()
        r1 = ck.save(1, state).result()
        v = base._version
        base.data[5] = 123.0          # .data: no version bump
        arr[7] = -1.0                 # numpy view of its own memory
        assert base._version == v
        r2 = ck.save(2, state).result()
        base.numpy()[9] = 7.0         # numpy view of the tensor's memory
        r3 = ck.save(3, state).result()
    assert r0.bytes_referenced == 0
    assert r1.bytes_referenced == base.numel() * 4 + arr.nbytes + 400
    assert r2.bytes_referenced == 0 and r3.bytes_referenced == arr.nbytes
    got = zerostall.load(ckdir, step=2)
    assert got["base"][5] == 123.0 and got["arr"][7] == -1.0
    got = zerostall.load(ckdir)
    assert torch.equal(got["base"], base) and np.array_equal(got["arr"], arr)
    assert torch.equal(got["view"], base[:100])


def test_version_mode_trusts_the_counter_as_documented(ckdir):
    """The faster mode misses a write that bypasses the version counter (the docs say so)."""
    t = torch.zeros(1 << 14)
    with zerostall.Checkpointer(ckdir, incremental="version") as ck:
        ck.save(0, {"t": t}).result()
        t.data[0] = 1.0
        assert ck.save(1, {"t": t}).result().bytes_referenced == t.numel() * 4
        t.add_(1.0)  # a torch op bumps the counter: written
        assert ck.save(2, {"t": t}).result().bytes_referenced == 0
    assert zerostall.load(ckdir, step=1)["t"][0] == 0.0  # the missed change
    assert torch.equal(zerostall.load(ckdir, step=2)["t"], t)


def test_retention_keeps_referenced_steps_then_frees_them(ckdir):
    frozen = torch.randn(1 << 16)
    with zerostall.Checkpointer(ckdir, incremental=True, keep_last=1, full_every=3) as ck:
        for step in range(3):
            ck.save(step, {"f": frozen, "x": torch.full((10,), float(step))}).result()
        assert ck.steps() == [0, 2]  # 2 borrows f from 0; 1 is gone
        ck.save(3, {"f": frozen, "x": torch.full((10,), 3.0)}).result()  # full (full_every=3)
        assert ck.steps() == [3]
        ck.save(4, {"f": frozen, "x": torch.full((10,), 4.0)}).result()
        assert ck.steps() == [3, 4]
    got = zerostall.load(ckdir)
    assert torch.equal(got["f"], frozen) and got["x"][0] == 4.0
    _verify_all(ckdir)


def test_retention_keeps_what_referenced_steps_reference(ckdir):
    """Closure: a kept step's referenced step stays loadable, so its own references stay too."""
    a, b = torch.randn(4096), torch.randn(4096)
    with zerostall.Checkpointer(ckdir, incremental=True, full_every=None) as ck:
        ck.save(0, {"a": a, "b": b}).result()
        b.add_(1)
        ck.save(1, {"a": a, "b": b}).result()   # a -> 0, b own
        ck.save(2, {"a": a, "b": b}).result()   # a -> 0, b -> 1
    tier = LocalTier(ckdir)
    man1 = tier.read_manifest(1)
    assert {r.step for r in man1.ref_files} == {0}
    assert prune(tier, tier.steps(), doomed(tier.steps(), 1)) == []  # 2 needs 1 and 0
    assert tier.steps() == [0, 1, 2]
    assert equal(zerostall.load(ckdir), {"a": a, "b": b})


def test_damaged_referenced_file_fails_every_dependent_and_falls_back(ckdir):
    frozen = torch.randn(1 << 16)
    with zerostall.Checkpointer(ckdir, incremental=True, full_every=2) as ck:
        for step in range(4):  # 0 full, 1 -> 0, 2 full, 3 -> 2
            ck.save(step, {"f": frozen, "x": torch.full((10,), float(step))}).result()
    tier = LocalTier(ckdir)
    assert [bool(tier.read_manifest(s).ref_files) for s in range(4)] == [False, True, False, True]
    name = tier.read_manifest(2).files[0].name
    path = os.path.join(tier.step_dir(2), name)
    off = next(e.offset for e in tier.read_manifest(2).tensors if e.key == "f")
    flip_byte(path, off + 100)
    eng = get_engine("threads", IOConfig())
    for s in (2, 3):
        with pytest.raises(CorruptCheckpoint, match=f"step-2/{name}|crc32c"):
            verify_step(tier, s, eng)
    verify_step(tier, 1, eng)
    eng.close()
    assert cli(["verify", ckdir]) == 1
    got = zerostall.load(ckdir)  # 3 and 2 fail; 1 (borrowing from 0) loads
    assert got["x"][0] == 1.0 and torch.equal(got["f"], frozen)


def test_a_restart_after_a_fallback_never_references_the_damaged_file(ckdir):
    """The newest step's file rotted; a restart loads an older step and saves on: the first
    save reads back what it would reference from disk, so it writes the damaged tensor again
    and every new step loads (with full_every=10 they all would have borrowed the bad bytes)."""
    frozen = torch.randn(1 << 14)
    with zerostall.Checkpointer(ckdir, incremental=True, full_every=2, keep_last=3) as ck:
        for step in range(4):  # 0 full, 1 -> 0, 2 full, 3 -> 2
            ck.save(step, {"f": frozen, "x": torch.full((10,), float(step))}).result()
    tier = LocalTier(ckdir)
    path = os.path.join(tier.step_dir(2), tier.read_manifest(2).files[0].name)
    off = next(e.offset for e in tier.read_manifest(2).tensors if e.key == "f")
    flip_byte(path, off + 100)
    state = zerostall.load(ckdir)  # 3 and 2 fail: step 1
    assert state["x"][0] == 1.0
    with zerostall.Checkpointer(ckdir, incremental=True, full_every=10, keep_last=3) as ck:
        for step in (4, 5):
            ck.save(step, {"f": state["f"], "x": torch.full((10,), float(step))}).result()
    for step in (4, 5):
        assert 2 not in {r.step for r in tier.read_manifest(step).ref_files}
        got = zerostall.load(ckdir, step=step)
        assert got["x"][0] == float(step) and torch.equal(got["f"], frozen)


def test_referenced_step_deleted_behind_our_back(ckdir):
    frozen = torch.randn(1 << 12)
    with zerostall.Checkpointer(ckdir, incremental=True) as ck:
        for step in range(3):
            ck.save(step, {"f": frozen, "x": torch.full((4,), float(step))}).result()
    import shutil
    shutil.rmtree(os.path.join(ckdir, "step-0"))
    with pytest.raises(CorruptCheckpoint, match="not a committed checkpoint"):
        zerostall.load(ckdir, fallback=False)
    with pytest.raises(CorruptCheckpoint, match="no checkpoint .* verifies"):
        zerostall.load(ckdir)  # 2 and 1 depend on 0: nothing left


def test_overwriting_a_referenced_step_is_refused(ckdir):
    frozen = torch.randn(1 << 12)
    with zerostall.Checkpointer(ckdir, incremental=True, allow_lower_steps=True) as ck:
        ck.save(0, {"f": frozen}).result()
        ck.save(1, {"f": frozen}).result()
        with pytest.raises(CheckpointExistsError, match="reference"):
            ck.save(0, {"f": frozen}, overwrite=True)
        ck.save(1, {"f": frozen + 1}, overwrite=True).result()  # nothing references 1
    assert torch.equal(zerostall.load(ckdir)["f"], frozen + 1)


@pytest.mark.parametrize("mode", [True, "version"])
def test_a_lower_step_never_references_a_higher_one(ckdir, mode):
    """allow_lower_steps: step 3 after step 10 writes its bytes (a manifest may only reference
    earlier steps, so a reference to step 10 would commit a step that never loads)."""
    state = {"f": torch.randn(1 << 12), "g": torch.randn(64)}
    with zerostall.Checkpointer(ckdir, incremental=mode, allow_lower_steps=True) as ck:
        ck.save(10, state).result()
        rec = ck.save(3, state).result()
        assert rec.bytes_referenced == 0
        rec = ck.save(11, state).result()  # references step 10 or 3, both earlier
        assert rec.bytes_referenced == (4096 + 64) * 4
    _verify_all(ckdir)
    for step in (3, 10, 11):
        assert equal(zerostall.load(ckdir, step=step), state)


def test_an_overwrite_queued_behind_a_save_that_references_the_step_is_refused(ckdir, monkeypatch):
    """save(1) is queued but not yet decided (so nothing pins step 0) when save(0, overwrite)
    passes its save()-time check; step 1 then references step 0. The overwrite must fail at
    its commit, or it commits and breaks step 1 (which had been reported durable)."""
    import threading

    from zerostall.saving.incremental import RefTracker
    go = threading.Event()
    decide = RefTracker.decide

    def held(self, req, *args):
        if req.step == 1:
            assert go.wait(60)
        return decide(self, req, *args)

    monkeypatch.setattr(RefTracker, "decide", held)
    frozen = torch.randn(1 << 14)
    with zerostall.Checkpointer(ckdir, incremental=True, allow_lower_steps=True) as ck:
        ck.save(0, {"f": frozen, "x": torch.zeros(3)}).result()
        h1 = ck.save(1, {"f": frozen, "x": torch.ones(3)})
        h0 = ck.save(0, {"f": frozen + 1, "x": torch.zeros(3)}, overwrite=True)
        go.set()
        assert h1.exception(60) is None
        assert isinstance(h0.exception(60), CheckpointExistsError)
        with pytest.raises(zerostall.errors.SaveFailed):
            h0.result()
    got = zerostall.load(ckdir, step=1, fallback=False)
    assert torch.equal(got["f"], frozen) and torch.equal(got["x"], torch.ones(3))
    assert torch.equal(zerostall.load(ckdir, step=0, fallback=False)["f"], frozen)


def test_restart_references_the_previous_run(ckdir):
    frozen = torch.randn(1 << 14)
    with zerostall.Checkpointer(ckdir, incremental=True) as ck:
        ck.save(0, {"f": frozen, "x": torch.zeros(3)}).result()
    with zerostall.Checkpointer(ckdir, incremental=True) as ck:  # a new process would do the same
        state = zerostall.load(ckdir)
        rec = ck.save(1, {"f": state["f"], "x": torch.ones(3)}).result()
    assert rec.bytes_referenced == frozen.numel() * 4
    assert torch.equal(zerostall.load(ckdir)["f"], frozen)


def test_state_larger_than_the_arena_streams(ckdir):
    """The ring reserves the worst case and releases what referenced tensors did not use."""
    frozen = [torch.randn(1 << 20) for _ in range(6)]  # 24 MiB through a 2-block (8 MiB) ring
    st = zerostall.config.StagingConfig(budget_bytes=8 << 20, block_bytes=4 << 20)
    with zerostall.Checkpointer(ckdir, staging=st, incremental=True) as ck:
        for step in range(4):
            x = torch.full((1 << 20,), float(step))
            ck.save(step, {"f": frozen, "x": x})
        ck.wait()
        recs = list(ck.records)
    assert [r.ok for r in recs] == [True] * 4
    assert recs[-1].bytes_referenced == 6 * (4 << 20)
    got = zerostall.load(ckdir)
    assert all(torch.equal(a, b) for a, b in zip(got["f"], frozen)) and got["x"][0] == 3.0


def test_cli_shows_owned_and_referenced(ckdir, capsys, tmp_path):
    frozen = torch.randn(1 << 14)
    with zerostall.Checkpointer(ckdir, incremental=True) as ck:
        ck.save(0, {"f": frozen, "x": torch.zeros(3)}).result()
        ck.save(1, {"f": frozen, "x": torch.ones(3)}).result()
    capsys.readouterr()
    assert cli(["ls", ckdir, "--json"]) == 0
    rows = {r["step"]: r for r in json.loads(capsys.readouterr().out)}
    assert rows[1]["bytes_referenced"] == frozen.numel() * 4 and rows[1]["references_steps"] == [0]
    assert rows[0]["bytes_referenced"] == 0 and rows[1]["bytes_owned"] == rows[1]["bytes"] == 8192
    assert cli(["verify", ckdir, "--step", "1"]) == 0
    assert "referenced in step(s) 0" in capsys.readouterr().out
    assert cli(["inspect", ckdir, "--step", "1"]) == 0
    assert "8.0 KiB owned + 64.0 KiB referenced" in capsys.readouterr().out
    assert cli(["inspect", ckdir, "--step", "1", "--json"]) == 0
    body = json.loads(capsys.readouterr().out)
    assert [t.get("step") for t in body["tensors"]] == [0, None] and body["ref_files"][0]["step"] == 0
    pytest.importorskip("safetensors")
    out = str(tmp_path / "x.safetensors")
    assert cli(["export", ckdir, "--step", "1", "--format", "safetensors", out]) == 0
    from safetensors.torch import load_file
    assert torch.equal(load_file(out)["f"], frozen)  # materialised


def test_bad_options():
    with pytest.raises(ConfigError, match="incremental"):
        zerostall.Checkpointer("/tmp/unused-zs", incremental="sometimes")
    with pytest.raises(ConfigError, match="full_every"):
        zerostall.CheckpointConfig(full_every=0)


@pytest.mark.gpu
def test_cuda_tensors_checked_on_the_device(ckdir):
    base = torch.randn(1 << 20, device="cuda")
    head = torch.randn(1000, device="cuda")
    with zerostall.Checkpointer(ckdir, incremental=True) as ck:
        ck.save(0, {"base": base, "head": head}).result()
        head.add_(1)
        r1 = ck.save(1, {"base": base, "head": head}).result()
        base.data[3] = 5.0  # bypasses the version counter; queued on the caller's stream
        r2 = ck.save(2, {"base": base, "head": head}).result()
    assert r1.bytes_referenced == base.numel() * 4 and r2.bytes_referenced == head.numel() * 4
    got = zerostall.load(ckdir)
    assert torch.equal(got["base"], base.cpu()) and torch.equal(got["head"], head.cpu())


@pytest.mark.parametrize("budget_mib", [64, 8])  # double buffered; streaming through a 2-block ring
def test_speculative_references_that_changed_are_appended(ckdir, budget_mib):
    """Unchanged-looking tensors are referenced on speculation while the changed ones are
    written; those whose crc32c then differs (writes around the version counter) are appended
    after the blocks already written, the header rewritten: every step loads bit-exact and
    verifies, and the next save references the appended bytes."""
    torch.manual_seed(1)
    frozen = {f"f{i}": torch.randn(300_000 + 1000 * i) for i in range(8)}  # ~1.2 MiB each, odd sizes
    head = torch.randn(1000)
    st = zerostall.config.StagingConfig(budget_bytes=budget_mib << 20, block_bytes=4 << 20)
    want, recs = [], []
    with zerostall.Checkpointer(ckdir, incremental=True, full_every=None, staging=st) as ck:
        for step in range(5):
            head.add_(1)
            if step == 2:
                frozen["f1"].data[7] = 1.0   # around the version counter
                frozen["f6"].numpy()[0] = 2.0
            if step == 3:
                for k in ("f0", "f3", "f4", "f7"):
                    frozen[k].data.mul_(2)
            state = {"frozen": frozen, "head": head}
            recs.append(ck.save(step, state).result())
            want.append(clone(state))
    per = {k: v.numel() * 4 for k, v in frozen.items()}
    assert recs[1].bytes_referenced == sum(per.values())
    assert recs[2].bytes_referenced == sum(per.values()) - per["f1"] - per["f6"]
    assert recs[3].bytes_referenced == sum(per[k] for k in ("f1", "f2", "f5", "f6"))
    assert recs[4].bytes_referenced == sum(per.values())  # including the appended bytes of 2 and 3
    for step, w in enumerate(want):
        assert equal(zerostall.load(ckdir, step=step, fallback=False), w), step
    _verify_all(ckdir)
    m3 = LocalTier(ckdir).read_manifest(3)
    own = sorted((e.offset, e.key) for e in m3.tensors if e.step is None)
    assert own[0] == (4096, "head")  # written at once; the four that changed appended after a block boundary
    assert len(own) == 5 and own[1][0] == 4 << 20 and all("f" in k for _, k in own[1:])


def test_appended_tensors_larger_than_the_ring_stream_through_it(ckdir):
    """Every tensor referenced on speculation changed (writes around the version counter) and
    the appended bytes (5 blocks) exceed a 2-block ring: the persist thread writes the
    appended blocks while they are staged (it waited for the whole snapshot to be staged,
    and the snapshot thread for ring slots only the persist thread frees: the save hung)."""
    torch.manual_seed(1)
    frozen = {f"f{i}": torch.randn(300_000 + 1000 * i) for i in range(8)}  # ~1.2 MiB each
    st = zerostall.config.StagingConfig(budget_bytes=8 << 20, block_bytes=4 << 20)
    ck = zerostall.Checkpointer(ckdir, incremental=True, full_every=None, staging=st)
    try:
        ck.save(0, {"frozen": frozen}).result(timeout=60)
        for k in frozen:
            frozen[k].data.mul_(2)
        rec = ck.save(1, {"frozen": frozen}).result(timeout=60)
        assert rec.bytes_referenced == 0
        assert rec.bytes_written >= sum(v.numel() * 4 for v in frozen.values())
    finally:
        ck.close(timeout=10)
    assert equal(zerostall.load(ckdir, step=1, fallback=False), {"frozen": frozen})
    assert [m.step for m in _verify_all(ckdir)] == [0, 1]  # raises if a step does not verify


@pytest.mark.parametrize("value", [1, 0, 1.0])
def test_incremental_is_a_bool_or_a_mode_name_not_a_number(tmp_path, value):
    # 1 == True and 0 == False, but neither names a mode: refused, never taken as some mode
    with pytest.raises(ConfigError, match="incremental"):
        zerostall.Checkpointer(str(tmp_path / "ck"), incremental=value)
