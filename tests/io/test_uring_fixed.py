"""The persist thread's registered (fixed) buffers: a shard written through io_uring's fixed
buffers holds the same bytes as one written with plain writes (the twin), also where an extent
lies outside the registered region or registration is refused; the region is registered once
per thread and released with the engine. Real io_uring, real O_DIRECT."""

import os
import threading

import pytest

from tests.helpers import skip_unless_engine
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
