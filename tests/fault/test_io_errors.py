"""EIO injected at the engine seam: the checkpoint fails, fsync is never retried, nothing committed."""

import errno
import os

import pytest
import torch

import zerostall
from zerostall.errors import StorageError
from zerostall.io import register_engine

from ..engines import FaultyEngine


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
