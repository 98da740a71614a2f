"""The content check's crc32c of a non-contiguous tensor equals that of its bytes in row-major
order (what staging writes), computed slice by slice without a whole copy (issue 23)."""

import os

import crc32c
import pytest
import torch

from zerostall import Checkpointer
from zerostall.config import StagingConfig
from zerostall.format.layout import HEADER_BYTES
from zerostall.saving import snapshot, source_crc
from zerostall.saving.snapshot import SMALL_ITEM_BYTES
from zerostall.store.local import LocalTier


def _views():
    g = torch.Generator().manual_seed(0)
    base = torch.randn(64, 48, 8, generator=g)
    return {"transposed": base.transpose(0, 2), "stride0": torch.randn(1, generator=g).expand(5000),
            "sliced": base[:, ::3, 1::2], "expanded_rows": torch.randn(7, generator=g).expand(300, 7),
            "bf16_permuted": base.to(torch.bfloat16).permute(1, 2, 0), "empty": base[:, :0]}


@pytest.mark.parametrize("name", list(_views()))
@pytest.mark.parametrize("limit", [64, 1000, 8 << 20])
def test_strided_crc_equals_the_contiguous_bytes(name, limit):
    t = _views()[name]
    want = crc32c.crc32c(t.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())
    assert source_crc._strided_crc(t, limit) == want


def test_cpu_crc_mixes_contiguous_and_strided():
    views = list(_views().values())
    crc = source_crc._CpuCrc(2)
    try:
        got = crc.many(views + [torch.arange(10.0)])
    finally:
        crc.close()
    want = [crc32c.crc32c(v.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())
            for v in views + [torch.arange(10.0)]]
    assert got == want


@pytest.mark.parametrize("name", ["transposed", "stride0", "sliced", "bf16_permuted"])
def test_device_path_slices_a_strided_tensor(name):
    """_CudaCrc's non-contiguous path, run on the CPU through its seams (a plain buffer, run() inline)."""
    t = _views()[name]
    c = source_crc._CudaCrc(piece=4096)
    c.buf = torch.empty(4096, dtype=torch.uint8)  # the pinned buffer, without CUDA
    want = crc32c.crc32c(t.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())
    assert c(t, lambda device, fn: fn()) == want


# ---- crc_at_copy: Checksumming at copy time (``snapshot.CRC_AT_COPY``, ``_fast.copy_crc``): a save of host
# tensors that checksums as it copies writes the same shard bytes and manifest crc32c as one whose
# persist thread checksums (the twin), for small tensors copied in runs, large ones across blocks,
# a strided view, an empty tensor, bf16; both load and verify. The copy+crc functions' own twin
# test is in tests/api/test_fast.py.


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
