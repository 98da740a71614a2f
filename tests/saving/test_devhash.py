"""The device-side content hash of incremental saves (:func:`zerostall.saving.source_crc.device_hash_async`), on the
CPU: the same torch ops run on CUDA (tests/saving/test_incremental_gpu.py compares them)."""

import json
import os

import numpy as np
import pytest
import torch

import zerostall
from zerostall.saving import content_check
from zerostall.saving import source_crc as devhash
from zerostall.saving.snapshot import Snapshotter


@pytest.mark.parametrize("n", [0, 1, 3, 4, 5, 17, 1000, 4099])
def test_matches_the_reference(n):
    b = torch.randint(0, 256, (n,), dtype=torch.uint8)
    assert devhash.device_hash(b) == devhash.reference_hash(bytes(b.numpy()))


def test_chunks_alignment_and_dtypes(monkeypatch):
    monkeypatch.setattr(devhash, "CHUNK_WORDS", 7)
    for n in (28, 29, 100, 1001):
        b = torch.randint(0, 256, (n,), dtype=torch.uint8)
        assert devhash.device_hash(b) == devhash.reference_hash(bytes(b.numpy()), 7)
        shifted = torch.empty(n + 1, dtype=torch.uint8)
        shifted[1:] = b
        assert devhash.device_hash(shifted[1:]) == devhash.device_hash(b)  # not 4-byte aligned: same value
    x = torch.randn(1001).to(torch.bfloat16)
    assert devhash.device_hash(x[1:]) == devhash.reference_hash(bytes(x[1:].contiguous().view(torch.uint8).numpy()), 7)


def test_every_single_word_change_and_swaps_are_detected(monkeypatch):
    monkeypatch.setattr(devhash, "CHUNK_WORDS", 64)
    base = torch.randn(1000)
    h0 = devhash.device_hash(base)
    for i in range(0, 1000, 7):
        for bit in (0, 13, 31):
            t = base.clone()
            t.view(torch.int32)[i] ^= 1 << bit
            assert devhash.device_hash(t) != h0, (i, bit)
    t = base.clone()
    t[[3, 500]] = t[[500, 3]]  # same words, other places (two chunks)
    assert devhash.device_hash(t) != h0
    assert devhash.device_hash(base[:999]) != h0  # the length counts
    with pytest.raises(ValueError, match="contiguous"):
        devhash.device_hash(torch.randn(4, 4).t())


class _FakeStreams:
    def run(self, device, fn, after=None):
        fn()


def test_device_path_through_the_seam(ckdir, monkeypatch):
    """CPU tensors taken through the device path: a full save hashes every tensor, an unchanged
    one is then checked by its hash alone (nothing through the host), a write that bypasses
    the version counter is caught, and every step loads bit-exact."""
    monkeypatch.setattr(content_check, "_on_device", lambda t: True)
    monkeypatch.setattr(Snapshotter, "_cuda", lambda self, device: _FakeStreams())
    base, head = torch.randn(1 << 16), torch.randn(100)
    jobs, want = [], []
    with zerostall.Checkpointer(ckdir, incremental=True, full_every=None) as ck:
        for step in range(4):
            if step == 2:
                base.data[5] = 1.5  # bypasses the version counter
            head.add_(1)
            h = ck.save(step, {"base": base, "head": head})
            h.result()
            jobs.append(h._job.incr)
            want.append((base.clone(), head.clone()))
    key_of = {i: json.loads(p)[0][1]["v"] for i, p in jobs[0].paths.items()}  # index -> top-level key
    assert {key_of[i] for i in jobs[0].dhs} == {"base", "head"} and jobs[0].full
    assert jobs[1].dev_hash_bytes == base.numel() * 4 and jobs[1].crc_bytes == 0
    assert {e.key for e in jobs[1].refs.values()} == {"base"}
    assert jobs[2].dev_hash_bytes == base.numel() * 4 and not jobs[2].refs  # the hash differed: written
    assert {e.key for e in jobs[3].refs.values()} == {"base"}
    for step, (b, hd) in enumerate(want):
        got = zerostall.load(ckdir, step=step)
        assert torch.equal(got["base"], b) and torch.equal(got["head"], hd)


def test_numpy_reference_of_int64_wrapping():
    """The hash relies on int64 products and sums wrapping modulo 2**64, in any order."""
    a = torch.randint(-(1 << 31), 1 << 31, (10 ** 5,), dtype=torch.int64)
    c = torch.randint(-(1 << 62), 1 << 62, (10 ** 5,), dtype=torch.int64) * 2 + 1
    got = int((a * c).sum())
    ref = int((a.numpy().astype(np.uint64) * c.numpy().astype(np.uint64)).sum(dtype=np.uint64))
    assert (got & ((1 << 64) - 1)) == ref and int((a * c).flip(0).sum()) == got


# ---- incremental_base_rewritten: An incremental base rewritten in place with its mtime put back (``rsync --inplace -t``,
# ``cp --preserve=timestamps`` over it, a tool restoring timestamps): the next save must not
# borrow its bytes.
#
# Found by adv2: the base file's stamp was (inode, size, mtime), all three unchanged by such a
# rewrite, so step 1 referenced the damaged span without reading it, was reported durable, and
# then failed its crc32c on every load. The inode's ctime cannot be set back from user space.


@pytest.mark.parametrize("mode", ["crc", "version"])
def test_base_rewritten_with_mtime_restored_is_not_borrowed(ckdir, mode):
    state = {"frozen": torch.arange(1 << 16, dtype=torch.float32), "head": torch.zeros(4)}
    with zerostall.Checkpointer(ckdir, incremental=mode, full_every=None) as ck:
        ck.save(0, state).result()
        d = os.path.join(ckdir, "step-0")
        shard = os.path.join(d, next(n for n in os.listdir(d) if n.endswith(".shard")))
        st = os.stat(shard)
        with open(shard, "r+b") as f:  # flip one payload byte of 'frozen', same size, same inode
            f.seek(4096 + 100)
            b = f.read(1)
            f.seek(4096 + 100)
            f.write(bytes([b[0] ^ 0xFF]))
        os.utime(shard, ns=(st.st_atime_ns, st.st_mtime_ns))
        state["head"] += 1
        ck.save(1, state).result()
    out = zerostall.load(ckdir, step=1)  # was CorruptCheckpoint: step 1 borrowed the damaged bytes
    assert torch.equal(out["frozen"], state["frozen"]) and torch.equal(out["head"], state["head"])
