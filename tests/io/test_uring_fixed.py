"""The persist thread's registered (fixed) buffers: a shard written through io_uring's fixed
buffers holds the same bytes as one written with plain writes (the twin), also where an extent
lies outside the registered region or registration is refused; the region is registered once
per thread and released with the engine. Real io_uring, real O_DIRECT."""

import ctypes
import mmap
import os
import threading
import types

import pytest

from tests.helpers import skip_unless_engine
from zerostall import _fast
from zerostall.config import IOConfig
from zerostall.io import choose_engine
from zerostall.io import uring
from zerostall.memory.arena import Arena

pytestmark = pytest.mark.timeout(120)
N = 4 << 20


def _write(eng, path, a, pin=None):
    if pin is not None:
        eng.pin_buffer(a.address, pin)
    with eng.open_write(path, N) as w:
        w.write([(0, a.mv[:N // 2]), (N // 2, a.mv[N // 2:N])])
        w.finish()
    with open(path, "rb") as f:
        return f.read()


def test_fixed_buffer_writes_equal_plain_writes(tmp_path):
    skip_unless_engine("uring")
    if not uring._HAS_FIXED:
        pytest.skip("this liburing binding exports no registered-buffer writes")
    a = Arena(N, mlock=False)
    a.wait_ready(N)
    a.mv[:N] = os.urandom(N)
    plain_eng = choose_engine(str(tmp_path), IOConfig(engine="uring"))
    eng = choose_engine(str(tmp_path), IOConfig(engine="uring"))
    try:
        plain = _write(plain_eng, str(tmp_path / "plain"), a)
        assert plain_eng.pinned_ring() is None
        fixed = _write(eng, str(tmp_path / "fixed"), a, pin=N)
        ring = eng.pinned_ring()
        assert ring is not None and ring.pinned == (a.address, N)
        half = _write(eng, str(tmp_path / "half"), a, pin=N // 2)  # the second extent: a plain write
        assert ring.pinned == (a.address, N // 2) and eng.pinned_ring() is ring  # re-registered, same ring
        refused = _write(eng, str(tmp_path / "refused"), a, pin=0)  # the kernel refuses an empty region
        assert ring.pinned is None and ring.refused == (a.address, 0)
        assert plain == fixed == half == refused == bytes(a.mv[:N])
        eng.pin_buffer(a.address, N)
        before = ring.pinned
        a.mv[:8] = b"remapped"  # the same pages; fresh=True registers them again all the same
        again = _write(eng, str(tmp_path / "again"), a, pin=N)  # no fresh: kept as registered
        eng.pin_buffer(a.address, N, fresh=True)
        assert before == ring.pinned == (a.address, N) and again == bytes(a.mv[:N])
        other: list = []  # another thread has no ring of its own until it pins
        t = threading.Thread(target=lambda: other.append(eng.pinned_ring()))
        t.start()
        t.join()
        assert other == [None]
    finally:
        eng.close()
        plain_eng.close()
    assert not ring.open and eng._pinned == []
    a.close()


def test_a_new_mapping_at_the_same_address_is_registered_anew(tmp_path):
    """A pool swap can leave a new arena where the registered one was: registered pages are the
    old mapping's, so ``fresh=True`` (the persist thread's, for another arena object) registers
    again and the file holds the new mapping's bytes."""
    skip_unless_engine("uring")
    if not uring._HAS_FIXED:
        pytest.skip("this liburing binding exports no registered-buffer writes")
    m = mmap.mmap(-1, N)
    addr = ctypes.addressof(ctypes.c_char.from_buffer(m))
    view = types.SimpleNamespace(address=addr, mv=memoryview(m))
    eng = choose_engine(str(tmp_path), IOConfig(engine="uring"))
    try:
        m[:] = b"A" * N
        assert _write(eng, str(tmp_path / "a"), view, pin=N) == b"A" * N
        got = _fast.libc.mmap(addr, N, mmap.PROT_READ | mmap.PROT_WRITE,
                              mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | 0x10, -1, 0)  # MAP_FIXED: new pages
        assert got == addr
        m[:] = b"B" * N
        eng.pin_buffer(addr, N, fresh=True)
        assert _write(eng, str(tmp_path / "b"), view) == b"B" * N
    finally:
        eng.close()
        view.mv.release()
        m.close()
