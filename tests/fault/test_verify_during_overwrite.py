"""``zerostall verify`` racing the owner: a step overwritten while verify reads it is read
again (verify used to report the old manifest + new shard as CORRUPT and exit 1), a step
deleted meanwhile (retention) is skipped, not failed; a damaged step still fails. The rule is
load's (``restore_retry``). The seam: an engine that lets the writer act just before verify
opens a shard (as in test_load_during_overwrite)."""

import glob

import pytest
import torch

import zerostall
from zerostall.cli import app as cli, verify as cli_verify
from zerostall.io.base import choose_engine

pytestmark = pytest.mark.timeout(120)


class _ActOnFirstOpen:
    def __init__(self, inner, act):
        self.inner, self.act, self.fired = inner, act, False

    def open_read(self, path):
        if not self.fired and "step-2" in path:
            self.fired = True
            self.act()
        return self.inner.open_read(path)

    def __getattr__(self, name):
        return getattr(self.inner, name)


def _verify_with(monkeypatch, root, act, capsys):
    eng = _ActOnFirstOpen(choose_engine(root), act)
    monkeypatch.setattr(cli_verify, "_engine", lambda name, r: eng)
    capsys.readouterr()
    rc = cli.main(["verify", root])
    out, err = capsys.readouterr()
    assert eng.fired
    return rc, out, err


def test_verify_while_the_step_is_overwritten(tmp_path, monkeypatch, capsys):
    root = str(tmp_path / "ck")
    with zerostall.Checkpointer(root) as ck:
        ck.save(1, {"a": torch.full((1000,), 1.0)})
        ck.save(2, {"a": torch.full((1000,), 2.0)})
        assert ck.wait(60)

        def overwrite():
            ck.save(2, {"a": torch.full((1000,), 3.0)}, overwrite=True)
            assert ck.wait(60)

        rc, out, err = _verify_with(monkeypatch, root, overwrite, capsys)
    assert rc == 0, err
    assert "step 1: OK" in out and "step 2: OK" in out and "FAILED" not in err


def test_verify_while_the_step_is_deleted(tmp_path, monkeypatch, capsys):
    root = str(tmp_path / "ck")
    with zerostall.Checkpointer(root) as ck:
        for s in (1, 2, 3):
            ck.save(s, {"a": torch.full((1000,), float(s))})
        assert ck.wait(60)
        rc, out, err = _verify_with(monkeypatch, root, lambda: ck.tier.delete(2), capsys)
    assert rc == 0, err
    assert "step 2: deleted while verifying" in out and "step 3: OK" in out and "FAILED" not in err


def test_a_damaged_step_still_fails(tmp_path, monkeypatch, capsys):
    root = str(tmp_path / "ck")
    zerostall.save(root, {"a": torch.full((1000,), 2.0)}, step=2)
    shard, = glob.glob(f"{root}/step-2/rank-*")

    def flip():
        with open(shard, "r+b") as f:
            f.seek(4096 + 10)
            b = f.read(1)
            f.seek(4096 + 10)
            f.write(bytes([b[0] ^ 1]))

    rc, out, err = _verify_with(monkeypatch, root, flip, capsys)
    assert rc == 1 and "step 2: FAILED" in err
