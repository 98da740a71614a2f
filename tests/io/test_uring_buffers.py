"""The uring engine pins no caller buffer after its request completes. liburing's ``Iovec``
never releases the buffer it was built from; built over arena slices (as it was), it kept
every arena it touched mapped after ``close()`` (the staging arena, each bounce buffer of a
restore or a remote copy) and leaked one slice per request. Real io_uring, real O_DIRECT."""

import gc
import os

import pytest

from tests.helpers import skip_unless_engine
from zerostall.config import IOConfig
from zerostall.io import choose_engine
from zerostall.memory.arena import Arena

pytestmark = pytest.mark.timeout(120)


def _views():
    gc.collect()
    return sum(1 for o in gc.get_objects() if type(o) is memoryview)


def test_uring_requests_pin_no_buffer(tmp_path):
    skip_unless_engine("uring")
    eng = choose_engine(str(tmp_path), IOConfig(engine="uring"))
    assert eng.name == "uring"
    path = str(tmp_path / "f")
    try:
        a = Arena(4 << 20, mlock=False)
        a.mv[:8] = b"zerostal"
        with eng.open_write(path, 4 << 20) as w:
            w.write([(0, a.mv[:4 << 20])])
            w.finish()
        a.close()
        assert a._map.closed, "the arena a write went through is still mapped after close()"

        b = Arena(4 << 20, mlock=False)
        before = _views()
        for _ in range(100):  # a steady restore layout: the same windows again and again
            with eng.open_read(path) as r:
                r.read([(0, b.mv[:1 << 20]), (1 << 20, b.mv[1 << 20:4 << 20])])
        assert bytes(b.mv[:8]) == b"zerostal"
        assert _views() - before < 16, "each request leaked a view"
        b.close()
        assert b._map.closed, "the arena a read went into is still mapped after close()"
    finally:
        eng.close()
        os.unlink(path)


@pytest.mark.parametrize("use_c", [True, False])
def test_cached_iovecs_over_a_reused_address_move_the_new_buffers_bytes(tmp_path, monkeypatch, use_c):
    """Iovecs are cached by (address, length). An arena closed and another mapped at the same
    address and length (mmap reuses it at once here) must get the new arena's bytes written
    and read, never a stale buffer's: 20 rounds, each with its own pattern, write then read back
    into a fresh arena, both ring paths (liburing's C API through ctypes, the binding)."""
    import ctypes

    from zerostall.io.uring import UringEngine
    skip_unless_engine("uring")
    monkeypatch.setattr(UringEngine, "use_c", use_c)
    eng = choose_engine(str(tmp_path), IOConfig(engine="uring"))
    n, addrs = 1 << 20, set()
    try:
        for i in range(20):
            path = str(tmp_path / f"f{i}")
            a = Arena(n, mlock=False)
            addrs.add(ctypes.addressof((ctypes.c_char * n).from_buffer(a.mv)))
            pattern = bytes([i + 1]) * n
            a.mv[:n] = pattern
            with eng.open_write(path, n) as w:
                w.write([(0, a.mv[:n])])
                w.finish()
            a.close()
            with open(path, "rb") as f:
                assert f.read() == pattern, f"round {i}: the file holds another buffer's bytes"
            b = Arena(n, mlock=False)
            addrs.add(ctypes.addressof((ctypes.c_char * n).from_buffer(b.mv)))
            b.mv[:n] = bytes(n)
            with eng.open_read(path) as r:
                r.read([(0, b.mv[:n])])
            assert bytes(b.mv[:n]) == pattern, f"round {i}: the read went into another buffer"
            b.close()
            os.unlink(path)
    finally:
        eng.close()
    print(f"{len(addrs)} distinct arena addresses in 40 mappings")
