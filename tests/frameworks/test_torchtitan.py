"""The torchtitan recipe of docs/integrations.md against torchtitan 0.3.0 (installed with
``pip install --no-deps -r requirements-torchtitan.txt``; skipped without it): its
CheckpointManager, built from the recipe's nested Config, driven on CPU, SIGKILLed inside a
first and a later save, and resumed through its own load() (``_find_load_step``)."""

import os
import subprocess
import sys

import pytest
import torch

pytest.importorskip("torchtitan.components.checkpoint")

from tests.frameworks import HERE, app_env  # noqa: E402
from tests.helpers import equal  # noqa: E402

import titan_app  # noqa: E402

STEPS = 6


def run(outdir, *args):
    env = app_env()
    for var in ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE", "LOCAL_RANK"):
        env.pop(var, None)
    return subprocess.run([sys.executable, os.path.join(HERE, "titan_app.py"), str(outdir), "--steps", str(STEPS), *args],
                          env=env, timeout=240, capture_output=True, text=True)


def test_the_nested_config_builds_the_subclass():
    """Without its own nested Config a subclass is never built: build() constructs the class
    that defines the Config (the docs' recipe before 0.3.0 did nothing)."""
    from torchtitan.components.checkpoint import CheckpointManager

    class NoConfig(CheckpointManager):
        pass

    kw = dict(dataloader=None, model_parts=[torch.nn.Linear(2, 2)], optimizers=None, lr_schedulers=None, states={},
              sd_adapter=None)
    cfg = dict(enable=True, keep_latest_k=0)
    assert type(NoConfig.Config(**cfg).build(**kw)) is CheckpointManager
    manager = titan_app.recipe()
    assert type(manager.Config(**cfg).build(**kw)) is manager


def test_sigkill_during_a_first_and_a_later_save_then_load(tmp_path):
    """Killed inside its first save, the run starts over (load() finds no committed step); killed
    inside its second, it resumes from step 2; both end with the same parameters."""
    finals = {}
    for kill_at_save, resumed_from in ((1, -1), (2, 2)):
        d = tmp_path / f"kill-{kill_at_save}"
        r = run(d, "--kill-at-save", str(kill_at_save))
        assert r.returncode == -9, r.stderr[-3000:]
        killed = d / "checkpoint" / f"step-{2 * kill_at_save}"
        assert killed.is_dir() and not (killed / ".metadata").exists()  # shards written, not committed
        r = run(d)
        assert r.returncode == 0, r.stderr[-3000:]
        assert (d / "resumed-from.txt").read_text() == str(resumed_from)
        finals[kill_at_save] = torch.load(d / "final.pt")
    # the run that started over is an uninterrupted one: the resumed run ends where it does
    assert equal(finals[2], finals[1])
    # the recipe's manager wrote zerostall shards under torchtitan's names (keep_latest_k=2, last step kept)
    ckdir = tmp_path / "kill-1" / "checkpoint"
    assert sorted(os.listdir(ckdir)) == ["step-2", "step-4", "step-6"]
    assert [f for f in os.listdir(ckdir / "step-4") if f.startswith("rank-")]
