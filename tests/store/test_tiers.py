"""The Tier protocol's local implementation: ownership, registry, engine choice, shard names."""

import dataclasses
import os
import shutil

import pytest
import torch

import zerostall
from zerostall.config import IOConfig
from zerostall.errors import ConfigError, RootLockedError
from zerostall.format.manifest import Manifest
from zerostall.io import choose_engine
from zerostall.store import remote as remote_mod
from zerostall.store.local import LocalTier
from zerostall.store.recovery import DECIDED_NAME
from zerostall.store.tier import Tier, open_tier, register_tier


def test_local_tier_implements_the_protocol(ckdir):
    t = LocalTier(ckdir, create=True)
    assert isinstance(t, Tier)
    assert t.steps() == [] and t.latest() is None


def test_second_writer_is_refused_naming_the_owner(ckdir):
    with zerostall.Checkpointer(ckdir) as c:
        c.save(1, {"x": torch.ones(4)}).result()
        with pytest.raises(RootLockedError) as ei:
            zerostall.Checkpointer(ckdir)
        msg = str(ei.value)
        assert f"pid {os.getpid()}" in msg and ckdir in msg and "lock_timeout_s" in msg
        assert ei.value.owner["pid"] == os.getpid()
        with pytest.raises(RootLockedError, match="waited 0.2 s"):
            zerostall.Checkpointer(ckdir, lock_timeout_s=0.2)
        assert zerostall.load(ckdir)["x"].sum().item() == 4  # readers need no lock
    with zerostall.Checkpointer(ckdir) as c2:  # released at close
        c2.save(2, {"x": torch.ones(4)}).result()
    assert LocalTier(ckdir).steps() == [1, 2]


def test_legacy_zst_shard_names_still_load(ckdir):
    state = {"w": torch.arange(1000, dtype=torch.float32)}
    zerostall.save(ckdir, state, step=3)
    d = os.path.join(ckdir, "step-3")
    assert sorted(os.listdir(d)) == ["manifest.json", "rank-00000.shard"]
    os.rename(os.path.join(d, "rank-00000.shard"), os.path.join(d, "rank-00000.zst"))
    man = Manifest.from_bytes(open(os.path.join(d, "manifest.json"), "rb").read())
    man = dataclasses.replace(man, files=tuple(dataclasses.replace(f, name="rank-00000.zst") for f in man.files),
                              tensors=tuple(dataclasses.replace(t, file="rank-00000.zst") for t in man.tensors))
    with open(os.path.join(d, "manifest.json"), "wb") as f:
        f.write(man.to_bytes())
    assert torch.equal(zerostall.load(ckdir)["w"], state["w"])


def test_registry_is_one_place_with_hints(tmp_path):
    assert not hasattr(remote_mod, "open_tier")  # one place: zerostall.store.tier (no alias elsewhere)
    with pytest.raises(ConfigError, match="no tier for nope://"):
        open_tier("nope://bucket/x")
    register_tier("zsbroken", "zerostall_no_such_module:Tier", "install zerostall[zsbroken]")
    with pytest.raises(ConfigError, match=r"install zerostall\[zsbroken\]"):
        open_tier("zsbroken://x")
    t = open_tier(str(tmp_path / "shared"))
    assert type(t).__name__ == "FileTier"


def test_choose_engine_is_the_one_place(tmp_path):
    eng = choose_engine(str(tmp_path), IOConfig(engine="threads"))
    assert eng.name == "threads"
    eng.close()
    auto = choose_engine(str(tmp_path))
    assert auto.name in ("uring", "threads", "buffered")
    auto.close()
    with pytest.raises(ConfigError, match="unknown I/O engine"):
        choose_engine(str(tmp_path), IOConfig(engine="nope"))


def test_distributed_ranks_all_refused_when_root_is_owned(tmp_path, ckdir):
    """Rank 0 owns a shared root for all ranks; when another process holds it, every rank gets
    RootLockedError from the start-up round, not a commit timeout."""
    import json
    import socket
    import subprocess
    import sys

    here = os.path.dirname(__file__)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with zerostall.Checkpointer(ckdir):
        procs = []
        for r in range(2):
            env = dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(r), WORLD_SIZE="2",
                       LOCAL_RANK=str(r), LOCAL_WORLD_SIZE="2")
            out = str(tmp_path / f"r{r}.json")
            procs.append((subprocess.Popen([sys.executable, os.path.join(here, "lock_worker.py"), ckdir, out],
                                           env=env, stderr=subprocess.PIPE, text=True), out))
        for p, out in procs:
            _, err = p.communicate(timeout=120)
            assert p.returncode == 0, err
            res = json.load(open(out))
            assert res["type"] == "RootLockedError", res
            assert f"pid {os.getpid()}" in res["error"]  # (a store timeout would name no owner)


def test_a_checkpointer_that_fails_to_start_releases_the_root(ckdir):
    with pytest.raises(ConfigError) as ei:
        zerostall.Checkpointer(ckdir, io=IOConfig(engine="nope"))
    assert ei.value.__traceback__ is not None  # the half-built object is still referenced here
    with zerostall.Checkpointer(ckdir) as c:
        c.save(1, {"x": torch.ones(2)}).result()


# ------------------------------------------------------------------------------------------------
# Start-up recovery completes a step the ranks' commit decision committed (its copy recorded
# ``manifest.decided``) and still removes every other unfinished save (issue 32, item 1).

def _decided_partial(root, step, as_step=None):
    """``step-<as_step>.partial`` holding ``step``'s shard and its manifest as the decision record."""
    part = os.path.join(root, f"step-{as_step or step}.partial")
    shutil.copytree(os.path.join(root, f"step-{step}"), part)
    os.rename(os.path.join(part, "manifest.json"), os.path.join(part, DECIDED_NAME))
    return part


def test_recovery_completes_a_decided_partial_and_removes_the_rest(tmp_path):
    root = str(tmp_path / "ck")
    zerostall.save(root, {"x": torch.arange(10.0)}, step=1)
    zerostall.save(root, {"x": torch.arange(10.0) * 2}, step=2)
    _decided_partial(root, 2)
    shutil.rmtree(os.path.join(root, "step-2"))  # killed between its record and its rename
    _decided_partial(root, 1, as_step=7)  # a record of another step: not this step's decision
    os.makedirs(os.path.join(root, "step-8.partial"))  # an unfinished save
    tier = LocalTier(root)
    done = tier.own()
    tier.release()
    assert tier.steps() == [1, 2], done
    assert sorted(n for n in os.listdir(root) if n.startswith("step-")) == ["step-1", "step-2"]
    assert any("completed step 2" in line for line in done), done
    assert torch.equal(zerostall.load(root, step=2)["x"], torch.arange(10.0) * 2)
