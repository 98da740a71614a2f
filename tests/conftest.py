import importlib.util
import os
import sys

import pytest
import torch

# zerostall_bench (bench/, beside src/) is installed by `make test`; a checkout run with only
# PYTHONPATH=src finds it here, and so do the processes the bench tests start.
_BENCH = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "bench")
if importlib.util.find_spec("zerostall_bench") is None and os.path.isdir(_BENCH):
    sys.path.insert(0, _BENCH)
    os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (_BENCH, os.environ.get("PYTHONPATH")) if p)

from tests.helpers import skip_unless_engine  # noqa: E402 (tests.helpers imports zerostall_bench)


@pytest.fixture(autouse=True)
def _torch_threads_restored():
    """Tests that pin torch to one thread (the HF/Lightning runs) give the rest of the suite its
    thread count back."""
    n = torch.get_num_threads()
    yield
    if torch.get_num_threads() != n:
        torch.set_num_threads(n)


@pytest.fixture(autouse=True)
def _release_staging_pool():
    """A test leaves no staging pool lingering behind it (RSS and address-space checks of the next)."""
    yield
    from zerostall.saving import pool
    pool.release_now()


@pytest.fixture
def ckdir(tmp_path):
    """A checkpoint directory on the real disk (tmp_path is on the machine's ext4)."""
    d = tmp_path / "ckpt"
    return str(d)


@pytest.fixture(params=["threads", "uring", "buffered"])
def engine_name(request):
    skip_unless_engine(request.param)
    return request.param


def pytest_collection_modifyitems(config, items):
    if not torch.cuda.is_available():
        skip = pytest.mark.skip(reason="needs a CUDA device")
        for it in items:
            if it.get_closest_marker("gpu") is not None:  # not it.keywords: a checkout in a dir named gpu
                it.add_marker(skip)
