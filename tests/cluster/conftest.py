import pytest

from .harness import Cluster, unavailable


@pytest.fixture
def cluster(tmp_path):
    """``cluster(n, **kw)`` builds a :class:`~tests.cluster.harness.Cluster` whose roots live
    under tmp_path; every cluster made is closed when the test ends (also after a failure)."""
    why = unavailable()
    if why:
        pytest.skip(why)
    made = []

    def make(n, **kw):
        c = Cluster(n, base=str(tmp_path / f"cluster{len(made)}"), **kw)
        made.append(c)
        return c
    yield make
    for c in made:
        c.close()


def pytest_collection_modifyitems(config, items):
    """The partition suite (``-m partitions``) runs only when asked for: deselected otherwise."""
    if "partitions" in (config.getoption("markexpr", "") or ""):
        return
    keep = [it for it in items if it.get_closest_marker("partitions") is None]
    if len(keep) != len(items):
        config.hook.pytest_deselected(items=[it for it in items if it.get_closest_marker("partitions")])
        items[:] = keep
