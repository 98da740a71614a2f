"""1M tensors saved and restored (#25): the state of a large MoE's per-parameter optimizer
kept small in bytes for CI (1M scalars, 4 MB of data). Packed (layout 2), the shard is the
data plus its header, not 1M pages (4 GB); the manifest fits the limit readers accept, and
the save's estimate of it (:func:`~zerostall.saving.plan.check_manifest_size`) bounds what
is written without refusing states that fit."""

import json
import os

import pytest
import torch

import zerostall
from zerostall.format import manifest as mf
from zerostall.saving.plan import DIM_BYTES, ENTRY_BYTES, entry_bound
from zerostall.store.local import LocalTier

pytestmark = pytest.mark.timeout(300)
N = 1_000_000


def test_a_million_tensors_saved_and_restored(tmp_path):
    state = {"s": [torch.full((), float(i)) for i in range(N)]}
    root = str(tmp_path / "ck")
    zerostall.save(root, state, step=1)  # not refused: the manifest estimate fits the limit
    step = os.path.join(root, "step-1")
    shard, = [n for n in os.listdir(step) if n.endswith(".shard")]
    assert os.path.getsize(os.path.join(step, shard)) <= 4096 + N * 4 + 4096  # header, 4 MB packed, last page
    assert os.path.getsize(os.path.join(step, "manifest.json")) <= mf.MAX_MANIFEST_BYTES // 2
    out = zerostall.load(root)  # verified: every crc32c and padding byte
    assert len(out["s"]) == N
    assert torch.equal(torch.stack(out["s"]), torch.arange(N, dtype=torch.float32))


def test_the_manifest_estimate_bounds_the_manifest_closely(tmp_path):
    state = {"optim": {f"state.{i}.exp_avg": torch.zeros(i % 3, 2) for i in range(20_000)}, "x": [torch.ones(1)] * 3}
    zerostall.save(str(tmp_path), state, step=1)
    man = LocalTier(str(tmp_path)).read_manifest(1)
    written = os.path.getsize(os.path.join(str(tmp_path), "step-1", "manifest.json"))
    bound = len(json.dumps(man.tree, separators=(",", ":"))) + sum(entry_bound(e.key, len(e.shape))
                                                                       for e in man.tensors)
    assert written <= bound < 2 * written  # a bound, and close: no state that fits is refused


def test_the_entry_bound_holds_for_the_widest_entry():
    """What one entry adds to the version 3 column table (its values and a comma per column),
    at every field's widest: a file index past 2**25 files, 2**62 offsets, sizes and dims."""
    from zerostall.format.table import encode_columns
    files = ["f0", "f1"]
    e = mf.TensorEntry("k" * 40, "float8_e4m3fnuz", (1 << 62,) * 3, "f1", (1 << 62) - 1, 1 << 62, 0xFFFFFFFF)
    other = mf.TensorEntry("j", "float32", (), "f0", 0, 0, 0)
    dumps = lambda v: len(json.dumps(v, separators=(",", ":")))  # noqa: E731
    big = encode_columns([other, e], files)
    big["dtype"][1], big["file"][1] = 99, 1 << 25  # the widest indices: < 100 dtypes, 2**25 files
    added = dumps(big) - dumps(encode_columns([other], files)) - len(json.dumps(e.dtype))
    assert added <= entry_bound(e.key, 3)
    assert ENTRY_BYTES < 100 and DIM_BYTES == 20
