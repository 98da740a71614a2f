import pytest

from zerostall import CheckpointConfig, IOConfig, StagingConfig
from zerostall.errors import ConfigError


def test_defaults_valid():
    c = CheckpointConfig()
    assert c.io.chunk_bytes == 8 << 20 and c.backpressure == "block"


@pytest.mark.parametrize("kw,field", [
    (dict(chunk_bytes=1000), "chunk_bytes"),
    (dict(queue_depth=0), "queue_depth"),
])
def test_io_invalid_names_field(kw, field):
    with pytest.raises(ConfigError, match=field):
        IOConfig(**kw)


def test_staging_and_top_invalid():
    with pytest.raises(ConfigError, match="budget_fraction"):
        StagingConfig(budget_fraction=1.5)
    with pytest.raises(ConfigError, match="backpressure"):
        CheckpointConfig(backpressure="drop")
    with pytest.raises(ConfigError, match="keep_last"):
        CheckpointConfig(keep_last=0)


def test_frozen():
    with pytest.raises(Exception):
        CheckpointConfig().keep_last = 3  # type: ignore[misc]


def test_env_overrides():
    c = CheckpointConfig.from_env(environ={"ZEROSTALL_ENGINE": "threads", "ZEROSTALL_QUEUE_DEPTH": "4",
                                           "ZEROSTALL_BUDGET_BYTES": str(64 << 20),
                                           "ZEROSTALL_BACKPRESSURE": "skip"})
    assert c.io.engine == "threads" and c.io.queue_depth == 4
    assert c.staging.budget_bytes == 64 << 20 and c.backpressure == "skip"
    with pytest.raises(ConfigError, match="ZEROSTALL_QUEUE_DEPTH"):
        CheckpointConfig.from_env(environ={"ZEROSTALL_QUEUE_DEPTH": "many"})


def test_dist_settings():
    assert CheckpointConfig(dist_mode="local").dist_mode == "local"
    assert CheckpointConfig().join_timeout_s <= 60
    with pytest.raises(ConfigError, match="join_timeout_s"):
        CheckpointConfig(join_timeout_s=0)
    with pytest.raises(ConfigError, match="dist_mode"):
        CheckpointConfig(dist_mode="rank0")
    with pytest.raises(ConfigError, match="dist_name"):
        CheckpointConfig(dist_name="")
    assert CheckpointConfig.from_env(environ={"ZEROSTALL_DIST_MODE": "local"}).dist_mode == "local"
