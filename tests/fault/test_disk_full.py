"""ENOSPC and RLIMIT_FSIZE: a clear error, training continues, nothing lost, recovery works."""

import errno
import os
import subprocess
import sys

import pytest
import torch

import zerostall
from zerostall.errors import SaveFailed, StorageError
from zerostall.io import register_engine

from ..engines import FaultyEngine


def test_enospc_on_small_filesystem(small_fs):
    root = os.path.join(small_fs, "ckpt")
    filler = os.path.join(small_fs, "filler")
    with open(filler, "wb") as f:
        f.write(b"\1" * (25 << 20))
        os.fsync(f.fileno())
    state = {"w": torch.ones(5 << 20)}  # 20 MiB
    with zerostall.Checkpointer(root) as ck:
        assert ck.save(1, state).result().ok
        h = ck.save(2, {"w": torch.full((5 << 20,), 2.0)})
        exc = h.exception()
        assert isinstance(exc, StorageError) and exc.errno == errno.ENOSPC
        msg = str(exc)
        assert "step-2.partial" in msg and (str(20 << 20) in msg.replace(",", "") or "bytes" in msg)
        assert "No space left" in msg and "free space" in msg
        # training continues: the next save() raises the stored error once, then works again
        with pytest.raises(SaveFailed, match="step 2"):
            ck.save(3, state)
        assert not os.path.exists(os.path.join(root, "step-2.partial"))
        assert ck.steps() == [1]
        assert zerostall.load(root)["w"].sum().item() == 5 << 20
        os.unlink(filler)
        assert ck.save(4, {"w": torch.full((5 << 20,), 4.0)}).result().ok
    assert zerostall.load(root)["w"][0].item() == 4.0
    assert zerostall.load(root, step=1)["w"][0].item() == 1.0


def test_rlimit_fsize(tmp_path):
    root = str(tmp_path / "ckpt")
    code = f"""
import resource, signal, torch, zerostall
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
resource.setrlimit(resource.RLIMIT_FSIZE, (4 << 20, 4 << 20))
with zerostall.Checkpointer({root!r}, raise_on_background_error=False) as ck:
    assert ck.save(1, {{"w": torch.ones(1000)}}).result().ok
    e = ck.save(2, {{"w": torch.ones(2 << 20)}}).exception()
    print(type(e).__name__, e.errno, e)
    print("steps", ck.steps())
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert f"StorageError {errno.EFBIG}" in out.stdout and "rank-00000.shard" in out.stdout
    assert "steps [1]" in out.stdout


# ---- io_errors: EIO injected at the engine seam: the checkpoint fails, fsync is never retried, nothing committed.


@pytest.mark.parametrize("where", ["write", "fdatasync"])
def test_eio(ckdir, where):
    box = {}
    register_engine("eio", lambda cfg: box.setdefault("e", FaultyEngine(cfg)))
    with zerostall.Checkpointer(ckdir, io=zerostall.IOConfig(engine="eio"), raise_on_background_error=False) as ck:
        ck.save(1, {"x": torch.ones(1 << 18)}).result()
        syncs = box["e"].syncs
        if where == "write":
            box["e"].fail_write = errno.EIO
        else:
            box["e"].fail_sync = errno.EIO
        exc = ck.save(2, {"x": torch.zeros(1 << 18)}).exception()
        assert isinstance(exc, StorageError) and exc.errno == errno.EIO
        assert ("fdatasync" in str(exc)) == (where == "fdatasync")
        assert box["e"].syncs == syncs + (1 if where == "fdatasync" else 0)  # one attempt, no retry
    assert ck.steps() == [1]
    assert not any(n.endswith(".partial") for n in os.listdir(ckdir))
    assert zerostall.load(ckdir)["x"].sum().item() == 1 << 18
