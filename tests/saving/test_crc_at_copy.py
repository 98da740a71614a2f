"""Checksumming at copy time (``snapshot.CRC_AT_COPY``, ``_fast.copy_crc``): a save of host
tensors that checksums as it copies writes the same shard bytes and manifest crc32c as one whose
persist thread checksums (the twin), for small tensors copied in runs, large ones across blocks,
a strided view, an empty tensor, bf16; both load and verify. The copy+crc functions' own twin
test is in tests/api/test_fast.py."""

import os

import torch

from zerostall import Checkpointer
from zerostall.config import StagingConfig
from zerostall.format.layout import HEADER_BYTES
from zerostall.saving import snapshot
from zerostall.saving.snapshot import SMALL_ITEM_BYTES
from zerostall.store.local import LocalTier


def _state():
    g = torch.Generator().manual_seed(3)
    big = torch.randn(3 * (SMALL_ITEM_BYTES // 4) + 77, generator=g)  # > 1 MiB: streamed block by block
    return {"small": [torch.randn(1000 + i, generator=g) for i in range(50)], "big": big,
            "strided": torch.randn(300, 200, generator=g).t(), "empty": torch.empty(0),
            "half": torch.randn(4097, generator=g).to(torch.bfloat16), "step": 7}


def _save(root, state, monkeypatch, enabled):
    monkeypatch.setattr(snapshot, "CRC_AT_COPY", enabled)
    with Checkpointer(root, staging=StagingConfig(block_bytes=1 << 20)) as ck:
        h = ck.save(1, state)
        assert h._job.crc_at_copy is enabled
        h.result()
        back = ck.load(step=1)
    step = os.path.join(root, "step-1")
    shard = [f for f in os.listdir(step) if f.endswith(".shard")][0]
    with open(os.path.join(step, shard), "rb") as f:
        body = f.read()[HEADER_BYTES:]  # the header names the save's id
    man = LocalTier(root).read_manifest(1)
    return body, [(e.key, e.offset, e.nbytes, e.crc32c) for e in man.tensors], back


def test_save_checksummed_at_copy_equals_the_persist_threads(tmp_path, monkeypatch):
    state = _state()
    fast = _save(str(tmp_path / "fast"), state, monkeypatch, True)
    plain = _save(str(tmp_path / "plain"), state, monkeypatch, False)
    assert fast[0] == plain[0] and fast[1] == plain[1] and len(fast[1]) == 54
    for back in (fast[2], plain[2]):  # both verify on load (every crc32c checked) and round-trip
        assert torch.equal(back["big"], state["big"]) and torch.equal(back["strided"], state["strided"])
        assert all(torch.equal(a, b) for a, b in zip(back["small"], state["small"]))
        assert back["half"].dtype == torch.bfloat16 and torch.equal(back["half"], state["half"])
