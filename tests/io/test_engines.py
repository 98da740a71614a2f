"""One suite, every engine: aligned round trips, short files, and no page-cache footprint."""

import os

import pytest
import torch

from zerostall.config import IOConfig
from zerostall.errors import StorageError
from zerostall.io import get_engine
from zerostall.memory.arena import Arena
from zerostall.telemetry.host import read_vmstat

from tests.helpers import resident_pages, skip_unless_engine


@pytest.mark.parametrize("nbytes", [4096, 12288, (8 << 20) + 4096, 3 * (8 << 20)])
def test_write_read_roundtrip(tmp_path, engine_name, nbytes):
    eng = get_engine(engine_name, IOConfig(chunk_bytes=1 << 20, queue_depth=4, threads=3))
    src = Arena(nbytes, mlock=False)
    src.u8.copy_(torch.randint(0, 256, (src.nbytes,), dtype=torch.uint8))
    path = str(tmp_path / "f")
    f = eng.open_write(path, nbytes)
    half = nbytes // 2 // 4096 * 4096
    f.write([(0, src.mv[:half]), (half, src.mv[half:nbytes])])  # two extents, chunked inside
    f.finish()
    f.close()
    assert os.path.getsize(path) == nbytes
    dst = Arena(nbytes, mlock=False)
    with eng.open_read(path) as r:
        r.read([(0, dst.mv[:nbytes])])
    assert torch.equal(src.u8[:nbytes], dst.u8[:nbytes])
    eng.close()


def test_read_past_end_is_an_error(tmp_path, engine_name):
    eng = get_engine(engine_name, IOConfig())
    path = str(tmp_path / "short")
    buf = Arena(8192, mlock=False)
    with eng.open_write(path, 4096) as f:
        f.write([(0, buf.mv[:4096])])
        f.finish()
    with eng.open_read(path) as r, pytest.raises(StorageError, match="short"):
        r.read([(0, buf.mv[:8192])])
    eng.close()


def test_create_refuses_existing(tmp_path, engine_name):
    eng = get_engine(engine_name, IOConfig())
    path = tmp_path / "exists"
    path.write_bytes(b"x")
    with pytest.raises(StorageError, match="exists"):
        eng.open_write(str(path), 4096)


@pytest.mark.parametrize("name", ["threads", "uring"])
def test_1gib_write_leaves_no_page_cache(tmp_path, name):
    """Direct engines: the shard's pages are not cached and nr_dirty barely moves."""
    skip_unless_engine(name)
    n = 1 << 30
    eng = get_engine(name, IOConfig())
    buf = Arena(n, mlock=False)
    buf.u8[::4096] = 7
    path = str(tmp_path / "big")
    before = read_vmstat()["nr_dirty"] * 4096
    peak = before
    f = eng.open_write(path, n)
    step = 128 << 20
    for off in range(0, n, step):
        f.write([(off, buf.mv[off:off + step])])
        peak = max(peak, read_vmstat()["nr_dirty"] * 4096)
    f.finish()
    f.close()
    resident, total = resident_pages(path)
    os.unlink(path)
    buf.close()
    eng.close()
    assert total == n // 4096
    assert resident < total // 100, f"{resident} of {total} pages cached"
    # other processes on the host may dirty pages too; our 1 GiB must not show up
    assert peak - before < 64 << 20
