import pytest

import zerostall
from zerostall import errors


def test_all_is_sorted_and_exact():
    assert zerostall.__all__ == sorted(zerostall.__all__)
    assert set(zerostall.__all__) == {
        "CheckpointConfig", "Checkpointer", "IOConfig", "LoadReport", "PeersConfig", "SaveHandle", "SaveRecord",
        "StagingConfig", "errors", "load", "register_type", "rng_state", "save", "set_rng_state"}
    for name in zerostall.__all__:
        assert getattr(zerostall, name) is not None
    assert set(zerostall.__all__) <= set(dir(zerostall))
    ns: dict = {}
    exec("from zerostall import *", ns)
    assert set(zerostall.__all__) <= set(ns)


def test_unknown_name_is_an_attribute_error():
    with pytest.raises(AttributeError, match="no attribute 'Checkpointr'"):
        zerostall.Checkpointr


def test_error_tree():
    for name in errors.__all__:
        assert issubclass(getattr(errors, name), Exception)
        if name != "ZerostallError":
            assert issubclass(getattr(errors, name), errors.ZerostallError)
