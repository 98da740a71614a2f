"""staging/snapshot.py copies runs of small contiguous CPU tensors by address (one C-level map
per run): every byte lands where the plan says, gaps are zero, runs stop at block ends, at big
tensors and at the writable end of the ring (a state larger than the arena streams through),
and the snapshot is still the state at save() time."""

import os

import torch

import zerostall
from zerostall import CheckpointConfig, Checkpointer, StagingConfig
from zerostall.saving import snapshot

from ..helpers import clone, equal

KiB, MiB = 1 << 10, 1 << 20


def _state(seed=0, n=3000):
    g = torch.Generator().manual_seed(seed)
    sizes = [1 + (i * 37) % 700 for i in range(n)]
    st = {f"s{i}": torch.randn(k, generator=g) for i, k in enumerate(sizes)}
    st["half"] = {f"h{i}": torch.randn(3, 5, generator=g).to(torch.bfloat16) for i in range(64)}
    st["big"] = torch.randn(3 * MiB // 4, generator=g)  # 3 MiB: over SMALL_ITEM_BYTES, streamed
    st["ints"] = {f"i{i}": torch.arange(i % 9, dtype=torch.int64) for i in range(64)}  # some empty
    st["tail"] = {f"t{i}": torch.randn(2, 2, generator=g) for i in range(40)}
    return st


def _count_runs(monkeypatch):
    runs = []
    real = snapshot.Snapshotter._copy_small

    def spy(self, job, offs, lens, ptrs, i, *crcs):
        j, end = real(self, job, offs, lens, ptrs, i, *crcs)
        runs.append(j - i)
        return j, end
    monkeypatch.setattr(snapshot.Snapshotter, "_copy_small", spy)
    return runs


def test_runs_bit_exact_through_a_small_ring(tmp_path, monkeypatch):
    runs = _count_runs(monkeypatch)
    state = _state()
    cfg = CheckpointConfig(staging=StagingConfig(budget_bytes=1 * MiB, block_bytes=256 * KiB, mlock=False,
                                                 hugepages=False))
    with Checkpointer(tmp_path / "ck", cfg) as ck:
        for step in range(3):  # the ring wraps inside the state, at another place each save
            rec = ck.save(step, state).result()
            assert rec.bytes > 4 * cfg.staging.budget_bytes  # streamed through the ring, wrapping
            assert equal(zerostall.load(tmp_path / "ck", step=step), state)
            for t in state["tail"].values():
                t.add_(1)
    assert sum(runs) > 3 * 3000 * 0.9  # nearly every small tensor went in a run
    assert max(runs) > 20  # runs of many tensors


def test_gaps_are_zero_on_disk(tmp_path):
    state = {f"k{i}": torch.full((1 + i % 5,), float(i + 1)) for i in range(500)}
    with Checkpointer(tmp_path / "ck") as ck:
        ck.save(1, state).result()
    from zerostall.store.local import LocalTier
    man = LocalTier(str(tmp_path / "ck")).read_manifest(1)
    raw = open(os.path.join(tmp_path / "ck", "step-1", man.files[0].name), "rb").read()
    spans = sorted((t.offset, t.offset + t.nbytes) for t in man.tensors)
    for (_, end), (nxt, _) in zip(spans, spans[1:]):
        assert raw[end:nxt].count(0) == nxt - end
    assert raw[spans[-1][1]:].count(0) == len(raw) - spans[-1][1]


def test_mutation_after_staged_is_not_in_the_snapshot(tmp_path):
    state = {f"k{i}": torch.full((7,), float(i)) for i in range(2000)}
    expected = clone(state)
    with Checkpointer(tmp_path / "ck") as ck:
        ck.save(1, state).result()
        h = ck.save(2, state)  # the cached plan
        h.wait_staged()
        for t in state.values():
            t.mul_(-1)
        h.result()
    assert equal(zerostall.load(tmp_path / "ck", step=2), expected)


def test_a_non_contiguous_tensor_takes_the_per_tensor_path(tmp_path, monkeypatch):
    runs = _count_runs(monkeypatch)
    state = {f"k{i}": torch.randn(5) for i in range(300)}
    state["nc"] = torch.randn(6, 4).t()
    with Checkpointer(tmp_path / "ck") as ck:
        ck.save(1, state).result()
    assert runs == []
    assert equal(zerostall.load(tmp_path / "ck", step=1), state)
