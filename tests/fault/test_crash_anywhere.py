"""SIGKILL a saving process at random moments, 30 times: the newest commit always loads."""

import zerostall
from zerostall.bench.crashsoak import run
from zerostall.store.local import LocalTier


def test_thirty_random_kills(tmp_path, capsys):
    t = run(str(tmp_path / "ckpt"), kills=30, seed=1234)
    with capsys.disabled():
        print(f"\ncrash-anywhere: {t.kills} kills, {t.ok} verified bit-exact, {t.empty} before the first commit, "
              f"{t.partial_seen} left a .partial, {t.leftovers_seen} other leftovers")
    zerostall.Checkpointer(str(tmp_path / "ckpt")).close()  # the next owner cleans every leftover
    tier = LocalTier(str(tmp_path / "ckpt"))
    assert tier.leftovers() == []
    assert len(tier.steps()) <= 4  # keep_last=3, +1 when a kill fell between commit and retention
    assert t.kills == 30
    assert t.failures == []
    assert t.ok + t.empty == 30
    assert t.ok >= 20  # most kills land after the first commit


def test_kills_with_incremental_saves(tmp_path, capsys):
    """The same, with a frozen part referenced across steps (and across restarts): retention
    deletes newest-first, so a kill mid-retention never orphans a reference."""
    t = run(str(tmp_path / "ckpt"), kills=20, seed=99, incremental=True)
    with capsys.disabled():
        print(f"\ncrash-anywhere (incremental): {t.kills} kills, {t.ok} verified bit-exact, "
              f"{t.referencing} with references")
    assert t.failures == []
    assert t.ok + t.empty == 20
    assert t.referencing >= 3  # the newest step often borrows the frozen part
