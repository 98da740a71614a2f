"""A step whose manifest.json is not a regular file (FIFO, directory, symlink, dangling
symlink) or whose step directory is a symlink is listed as damaged by ``ls`` and makes
``verify`` exit 1 naming the file, on the local tier and on a shared-filesystem tier; nothing
hangs on a FIFO. The old listing skipped such steps, so ``verify`` printed OK."""

import json
import os
import shutil

import pytest
import torch

import zerostall
from zerostall.cli.app import main
from zerostall.format.manifest import MANIFEST_NAME
from zerostall.store.local import LocalTier
from zerostall.store.sharedfs import FileTier

pytestmark = pytest.mark.timeout(120)


def _fifo(p):
    os.mkfifo(p)


def _dir(p):
    os.mkdir(p)


def _symlink(p):
    shutil.copy(p + ".orig", p + ".elsewhere")
    os.symlink(p + ".elsewhere", p)


def _dangling(p):
    os.symlink(p + ".nowhere", p)


DAMAGE = {"fifo": _fifo, "dir": _dir, "symlink": _symlink, "dangling": _dangling}


def _root(tmp_path):
    d = str(tmp_path / "ck")
    for s in (1, 2):
        zerostall.save(d, {"w": torch.full((64,), float(s))}, step=s)
    return d


@pytest.mark.parametrize("kind", sorted(DAMAGE) + ["step_dir_symlink"])
@pytest.mark.parametrize("where", ["local", "file"])
def test_damaged_manifest_is_listed_and_fails_verify(tmp_path, capsys, kind, where):
    d = _root(tmp_path)
    man = os.path.join(d, "step-2", MANIFEST_NAME)
    if kind == "step_dir_symlink":  # a whole step directory that lives elsewhere
        os.rename(os.path.join(d, "step-2"), str(tmp_path / "outside"))
        os.symlink(str(tmp_path / "outside"), os.path.join(d, "step-2"))
    else:
        os.rename(man, man + ".orig")
        DAMAGE[kind](man)
    arg = d if where == "local" else f"file://{d}"

    assert main(["verify", arg]) == 1
    out, err = capsys.readouterr()
    assert "step 1: OK" in out
    assert "step 2: FAILED" in err and "step-2" in err, err

    assert main(["ls", "--json", arg]) == 0
    rows = {r["step"]: r for r in json.loads(capsys.readouterr().out)}
    assert sorted(rows) == [1, 2]
    assert rows[1]["state"] == "committed"
    assert rows[2]["state"].startswith("invalid manifest") and "step-2" in rows[2]["state"]

    tier = LocalTier(d) if where == "local" else FileTier(arg)
    assert tier.listed_steps() == [1, 2]
    assert tier.steps() == [1]  # never counted as committed (retention, load)
    assert zerostall.load(d)["w"][0].item() == 1.0  # load falls back to step 1
