"""A step overwritten while it is read: load() and verify() see a whole step, never a torn one.

A reader loading a step while its writer overwrites it gets a whole step, not a failure.

The overwrite swaps ``step-N`` atomically, but a reader that read the old manifest then opens
the new shard (its header names another checkpoint). ``load()`` must see that the step was
replaced under it and read it again, not report it corrupt (or fall back to an older step).
The seam: an engine that lets the writer overwrite the step just before the reader opens the
shard.
"""

import glob

import pytest
import torch

import zerostall
from zerostall import LoadReport
from zerostall.cli import app as cli, verify as cli_verify
from zerostall.io.base import choose_engine
from zerostall.restore import load


class _OverwriteOnFirstOpen:
    def __init__(self, inner, overwrite):
        self.inner, self.overwrite, self.fired = inner, overwrite, False

    def open_read(self, path):
        if not self.fired:
            self.fired = True
            self.overwrite()
        return self.inner.open_read(path)

    def __getattr__(self, name):
        return getattr(self.inner, name)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("older", [False, True])
def test_load_while_the_step_is_overwritten(tmp_path, older):
    root = str(tmp_path / "ck")
    with zerostall.Checkpointer(root) as ck:
        if older:
            ck.save(1, {"a": torch.full((1000,), 1.0)})
        ck.save(2, {"a": torch.full((1000,), 2.0)})
        ck.wait()

        def overwrite():
            ck.save(2, {"a": torch.full((1000,), 3.0)}, overwrite=True)
            assert ck.wait(60)

        eng = _OverwriteOnFirstOpen(choose_engine(root), overwrite)
        report = LoadReport()
        got = load(root, engine=eng, report=report)
        eng.inner.close()
    assert eng.fired
    assert report.step == 2 and report.failed == []
    assert torch.equal(got["a"], torch.full((1000,), 3.0))


# ``zerostall verify`` racing the owner: a step overwritten while verify reads it is read
# again (verify used to report the old manifest + new shard as CORRUPT and exit 1), a step
# deleted meanwhile (retention) is skipped, not failed; a damaged step still fails. The rule is
# load's (``restore_retry``). The seam: an engine that lets the writer act just before verify
# opens a shard (as in the load test above).

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


@pytest.mark.timeout(120)
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


@pytest.mark.timeout(120)
def test_verify_while_the_step_is_deleted(tmp_path, monkeypatch, capsys):
    root = str(tmp_path / "ck")
    with zerostall.Checkpointer(root) as ck:
        for s in (1, 2, 3):
            ck.save(s, {"a": torch.full((1000,), float(s))})
        assert ck.wait(60)
        rc, out, err = _verify_with(monkeypatch, root, lambda: ck.tier.delete(2), capsys)
    assert rc == 0, err
    assert "step 2: deleted while verifying" in out and "step 3: OK" in out and "FAILED" not in err


@pytest.mark.timeout(120)
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
