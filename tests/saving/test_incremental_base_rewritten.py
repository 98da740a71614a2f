"""An incremental base rewritten in place with its mtime put back (``rsync --inplace -t``,
``cp --preserve=timestamps`` over it, a tool restoring timestamps): the next save must not
borrow its bytes.

Found by adv2: the base file's stamp was (inode, size, mtime), all three unchanged by such a
rewrite, so step 1 referenced the damaged span without reading it, was reported durable, and
then failed its crc32c on every load. The inode's ctime cannot be set back from user space."""

import os

import pytest
import torch

import zerostall


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
