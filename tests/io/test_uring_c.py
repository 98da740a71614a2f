"""The uring engine drives its rings through liburing's C functions by ctypes (GIL released
around io_uring_submit and the completion wait); the binding is never imported. Real io_uring,
O_DIRECT."""

import ctypes
import gc
import mmap
import os
import subprocess
import sys
import threading
import types

import pytest

from zerostall import _fast
from zerostall.config import IOConfig
from zerostall.errors import StorageError
from zerostall.io import choose_engine, uring
from zerostall.memory.arena import Arena

from tests.helpers import skip_unless_engine

pytestmark = pytest.mark.timeout(120)
MiB = 1 << 20


def _engine(tmp_path):
    skip_unless_engine("uring")
    eng = choose_engine(str(tmp_path), IOConfig(engine="uring", chunk_bytes=1 * MiB, queue_depth=4))
    assert eng.name == "uring"
    return eng


def _buf(n, seed):
    m = mmap.mmap(-1, n)
    m.write(bytes((i * 7 + seed) % 251 for i in range(256)) * (n // 256))
    return m


def test_round_trip_and_report_short_files(tmp_path):
    eng = _engine(tmp_path)
    n = 5 * MiB + 8192
    src, dst = _buf(n, 1), _buf(n, 2)
    path = str(tmp_path / "f")
    with eng.open_write(path, n) as f:
        assert f.cring is not None
        f.write([(0, memoryview(src)[:3 * MiB]), (3 * MiB, memoryview(src)[3 * MiB:])])
        f.finish()
    with eng.open_read(path) as f:
        f.read([(0, memoryview(dst))])
    assert src[:] == dst[:]
    big = _buf(n + 4 * MiB, 3)
    with eng.open_read(path) as f, pytest.raises(StorageError, match="transferred 0"):
        f.read([(0, memoryview(big))])  # past the end of the file


def test_the_engine_never_imports_the_binding(tmp_path):
    """The binding's calls hold the GIL (and its builds can need CPU instructions a host lacks):
    a save and a load through the uring engine never import it."""
    skip_unless_engine("uring")
    ck = str(tmp_path / "ck")
    code = ("import sys, torch, zerostall\n"
            "from zerostall.config import IOConfig\n"
            f"zerostall.save({ck!r}, {{'w': torch.arange(4096.0)}}, 1, io=IOConfig(engine='uring'))\n"
            f"assert zerostall.load({ck!r}, io=IOConfig(engine='uring'))['w'][5] == 5\n"
            "print(sorted(m for m in sys.modules if m.split('.')[0] == 'liburing'))\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]", out.stdout


def test_a_read_only_buffer_is_written(tmp_path):
    eng = _engine(tmp_path)
    src = _buf(1 * MiB, 5)  # page-aligned, as O_DIRECT needs
    path = str(tmp_path / "h")
    with eng.open_write(path, len(src)) as f:
        f.write([(0, memoryview(src).toreadonly())])  # ctypes takes no read-only buffer: numpy gives its address
        f.finish()
    with open(path, "rb") as fh:
        assert fh.read() == src[:]


# ------------------------------------------------------------------------------------------------
# The uring engine pins no caller buffer after its request completes. liburing's ``Iovec``
# never releases the buffer it was built from; built over arena slices (as it was), it kept
# every arena it touched mapped after ``close()`` (the staging arena, each bounce buffer of a
# restore or a remote copy) and leaked one slice per request. Real io_uring, real O_DIRECT.

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


def test_a_reused_address_moves_the_new_buffers_bytes(tmp_path):
    """An arena closed and another mapped at the same address and length (mmap reuses it at once
    here) must get the new arena's bytes written and read, never a stale buffer's: 20 rounds, each
    with its own pattern, write then read back into a fresh arena."""
    skip_unless_engine("uring")
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


# ------------------------------------------------------------------------------------------------
# The persist thread's registered (fixed) buffers: a shard written through io_uring's fixed
# buffers holds the same bytes as one written with plain writes (the twin), also where an extent
# lies outside the registered region or registration is refused; the region is registered once
# per thread and released with the engine. Real io_uring, real O_DIRECT.

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
