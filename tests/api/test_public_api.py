import zerostall
from zerostall import errors


def test_all_is_sorted_and_exact():
    assert zerostall.__all__ == sorted(zerostall.__all__)
    assert set(zerostall.__all__) == {
        "CheckpointConfig", "Checkpointer", "IOConfig", "LoadReport", "PeersConfig", "SaveHandle", "SaveRecord",
        "StagingConfig", "errors", "load", "register_type", "rng_state", "save", "set_rng_state"}
    for name in zerostall.__all__:
        assert getattr(zerostall, name) is not None


def test_error_tree():
    for name in errors.__all__:
        assert issubclass(getattr(errors, name), Exception)
        if name != "ZerostallError":
            assert issubclass(getattr(errors, name), errors.ZerostallError)
