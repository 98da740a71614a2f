"""Incremental saves of CUDA tensors: unchanged tensors are checked by a hash computed on the
device (8 bytes per tensor come back), the first save after a restart through the host once.
Run with ``pytest -m gpu`` on a machine with a CUDA device (skipped elsewhere)."""

import pytest
import torch

import zerostall
from zerostall.saving import source_crc as devhash

pytestmark = [pytest.mark.gpu, pytest.mark.timeout(300)]


def test_device_hash_equals_the_cpu_hash(monkeypatch):
    tensors = [torch.randn(n) for n in (0, 1, 1000, (1 << 22) + 3)]
    tensors += [torch.randn(1001).to(torch.bfloat16)[1:], torch.randint(0, 255, (4099,), dtype=torch.uint8),
                torch.randn(7, 9, dtype=torch.float64), torch.randn(33).to(torch.float16)]
    for t in tensors:
        assert devhash.device_hash(t.cuda()) == devhash.device_hash(t), (t.dtype, t.shape)
    devhash.clear_cache()
    monkeypatch.setattr(devhash, "CHUNK_WORDS", 1000)  # many chunks
    try:
        for t in tensors:
            assert devhash.device_hash(t.cuda()) == devhash.device_hash(t), (t.dtype, t.shape)
        small = torch.randint(0, 256, (4003,), dtype=torch.uint8)
        assert devhash.device_hash(small.cuda()) == devhash.reference_hash(bytes(small.numpy()), 1000)
    finally:
        devhash.clear_cache()


def test_unchanged_cuda_tensors_are_checked_on_the_device(ckdir):
    base = torch.randn(5 << 20, device="cuda")  # 20 MiB: two hash chunks
    head = torch.randn(1000, device="cuda")
    bf = torch.randn(1001, device="cuda").to(torch.bfloat16)[1:]  # not 4-byte aligned
    state = {"base": base, "head": head, "bf": bf}
    with zerostall.Checkpointer(ckdir, incremental=True, full_every=None) as ck:
        ck.save(0, state).result()
        head.add_(1)
        h1 = ck.save(1, state)
        r1 = h1.result()
        want1 = {k: v.cpu() for k, v in state.items()}
        base.data[3] = 5.0  # bypasses the version counter; queued on the caller's stream
        h2 = ck.save(2, state)
        r2 = h2.result()
    nb, nh, nf = base.numel() * 4, head.numel() * 4, bf.numel() * 2
    assert r1.bytes_referenced == nb + nf and r2.bytes_referenced == nh + nf
    for h, hashed in ((h1, nb + nf), (h2, nb + nh + nf)):
        assert h._job.incr.dev_hash_bytes == hashed and h._job.incr.crc_bytes == 0  # nothing through the host
    got = zerostall.load(ckdir, step=1)
    assert all(torch.equal(got[k], want1[k]) for k in state)
    got = zerostall.load(ckdir)
    assert all(torch.equal(got[k], v.cpu()) for k, v in state.items())


def test_after_a_restart_the_first_save_checks_through_the_host(ckdir):
    t = torch.randn(1 << 20, device="cuda")
    with zerostall.Checkpointer(ckdir, incremental=True) as ck:
        ck.save(0, {"t": t}).result()
    with zerostall.Checkpointer(ckdir, incremental=True) as ck:  # the base comes from disk: no device hash
        h1 = ck.save(1, {"t": t})
        r1 = h1.result()
        h2 = ck.save(2, {"t": t})
        r2 = h2.result()
    assert r1.bytes_referenced == r2.bytes_referenced == t.numel() * 4
    assert h1._job.incr.crc_bytes == t.numel() * 4 and h1._job.incr.dev_hash_bytes == 0
    assert h2._job.incr.dev_hash_bytes == t.numel() * 4 and h2._job.incr.crc_bytes == 0
    assert torch.equal(zerostall.load(ckdir)["t"], t.cpu())
