"""store/atomic.py: the directory publish/discard/recover primitives (LocalTier and DCP use them)."""

import os

import pytest

from zerostall.store.atomic import discard, publish_dir, recover_dir, rename_exchange


def _mk(path, text):
    os.makedirs(path)
    with open(os.path.join(path, "ok"), "w") as f:
        f.write(text)


def _text(path):
    return open(os.path.join(path, "ok")).read()


def _valid(d):
    return os.path.isfile(os.path.join(d, "ok"))


def test_rename_exchange_swaps(tmp_path):
    a, b = str(tmp_path / "a"), str(tmp_path / "b")
    _mk(a, "A")
    _mk(b, "B")
    if not rename_exchange(a, b):
        pytest.skip("this filesystem cannot RENAME_EXCHANGE")
    assert _text(a) == "B" and _text(b) == "A"
    with pytest.raises(FileNotFoundError):
        rename_exchange(a, str(tmp_path / "missing"))


@pytest.mark.parametrize("exchange", [True, False])
def test_publish_new_and_overwrite(tmp_path, exchange):
    final, staged = str(tmp_path / "ck"), str(tmp_path / "ck.partial")
    _mk(staged, "v1")
    assert publish_dir(staged, final, exchange=exchange) == "rename"
    _mk(staged, "v2")
    with pytest.raises(FileExistsError):
        publish_dir(staged, final)
    seen = []
    how = publish_dir(staged, final, overwrite=True, exchange=exchange, hook=seen.append)
    assert how in (("exchange", "two-phase") if exchange else ("two-phase",))
    assert _text(final) == "v2" and sorted(os.listdir(tmp_path)) == ["ck"]
    assert seen.index("fsync_root") < seen.index("unlink")  # the parent is fsynced before the old copy goes


def test_recover_dir(tmp_path):
    final = str(tmp_path / "ck")
    _mk(final + ".old", "old")  # crash between the two renames: final missing
    assert "restored" in recover_dir(final, _valid)[0]
    assert _text(final) == "old" and not os.path.exists(final + ".old")
    _mk(final + ".old", "older")  # crash after the new copy went in
    assert "removed" in recover_dir(final, _valid)[0]
    assert _text(final) == "old" and sorted(os.listdir(tmp_path)) == ["ck"]
    os.rename(final, str(tmp_path / "elsewhere"))
    os.makedirs(final + ".old")  # neither copy valid: the old one is removed, not restored
    assert "no valid" in recover_dir(final, _valid)[0]
    assert not os.path.exists(final) and not os.path.exists(final + ".old")
    assert recover_dir(final, _valid) == []


def test_discard_leaves_only_a_deleting_entry_on_crash(tmp_path):
    d = str(tmp_path / "x")
    _mk(d, "x")

    class Stop(Exception):
        pass

    def hook(name):
        if name == "rename_deleting":
            raise Stop

    with pytest.raises(Stop):
        discard(d, hook)
    (left,) = os.listdir(tmp_path)
    assert left.startswith(".deleting-x-")
