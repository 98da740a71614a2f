"""The content check's crc32c of a non-contiguous tensor equals that of its bytes in row-major
order (what staging writes), computed slice by slice without a whole copy (issue 23)."""

import crc32c
import pytest
import torch

from zerostall.saving import source_crc


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
