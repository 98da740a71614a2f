"""The uring engine drives its rings through liburing's C functions by ctypes (GIL released
around io_uring_submit and the completion wait); the binding's own calls hold the GIL. Both
paths write and read the same bytes and report errors the same way. Real io_uring, O_DIRECT."""

import mmap
import os

import pytest

import zerostall.io.uring as U
from tests.helpers import skip_unless_engine
from zerostall.config import IOConfig
from zerostall.errors import StorageError
from zerostall.io import choose_engine

pytestmark = pytest.mark.timeout(120)
MiB = 1 << 20


def _engine(tmp_path, use_c, monkeypatch):
    skip_unless_engine("uring")
    monkeypatch.setattr(U.UringEngine, "use_c", use_c)
    eng = choose_engine(str(tmp_path), IOConfig(engine="uring", chunk_bytes=1 * MiB, queue_depth=4))
    assert eng.name == "uring"
    return eng


def _buf(n, seed):
    m = mmap.mmap(-1, n)
    m.write(bytes((i * 7 + seed) % 251 for i in range(256)) * (n // 256))
    return m


@pytest.mark.parametrize("use_c", [True, False])
def test_both_paths_round_trip_and_report_short_files(tmp_path, monkeypatch, use_c):
    if use_c and U._C is None:
        pytest.skip("this liburing build does not export its C functions")
    eng = _engine(tmp_path, use_c, monkeypatch)
    n = 5 * MiB + 8192
    src, dst = _buf(n, 1), _buf(n, 2)
    path = str(tmp_path / "f")
    with eng.open_write(path, n) as f:
        assert (f.cring is not None) == use_c
        f.write([(0, memoryview(src)[:3 * MiB]), (3 * MiB, memoryview(src)[3 * MiB:])])
        f.finish()
    with eng.open_read(path) as f:
        f.read([(0, memoryview(dst))])
    assert src[:] == dst[:]
    big = _buf(n + 4 * MiB, 3)
    with eng.open_read(path) as f, pytest.raises(StorageError, match="transferred 0"):
        f.read([(0, memoryview(big))])  # past the end of the file


def test_the_c_path_never_calls_the_bindings_submit(tmp_path, monkeypatch):
    """The binding's io_uring_submit holds the GIL: with the C path it is not called at all."""
    if U._C is None:
        pytest.skip("this liburing build does not export its C functions")
    eng = _engine(tmp_path, True, monkeypatch)

    def holds_the_gil(ring):
        raise AssertionError("the binding's io_uring_submit was called")

    monkeypatch.setattr(U.L, "io_uring_submit", holds_the_gil)
    src = _buf(2 * MiB, 4)
    path = str(tmp_path / "g")
    with eng.open_write(path, 2 * MiB) as f:
        f.write([(0, memoryview(src))])
        f.finish()
    assert os.path.getsize(path) == 2 * MiB


def test_a_read_only_buffer_goes_through_the_binding(tmp_path, monkeypatch):
    if U._C is None:
        pytest.skip("this liburing build does not export its C functions")
    eng = _engine(tmp_path, True, monkeypatch)
    src = _buf(1 * MiB, 5)  # page-aligned, as O_DIRECT needs
    path = str(tmp_path / "h")
    with eng.open_write(path, len(src)) as f:
        f.write([(0, memoryview(src).toreadonly())])  # no address for ctypes: the binding writes it
        f.finish()
    with open(path, "rb") as fh:
        assert fh.read() == src[:]
