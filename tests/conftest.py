import pytest
import torch

from tests.helpers import skip_unless_engine



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
