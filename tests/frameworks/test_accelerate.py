"""Accelerate through zerostall: accelerator.save_state()/load_state() with automatic checkpoint
naming, SIGKILLed during a first and a later save, resumed bit-exactly; the checkpoint counter
and total_limit as Accelerate's own."""

import os

import pytest
import torch

pytest.importorskip("accelerate")

from tests.frameworks import export, run_app  # noqa: E402
from tests.helpers import equal  # noqa: E402
from zerostall.store.local import LocalTier  # noqa: E402

import accelerate_app as app  # noqa: E402

STEPS = 12


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """Accelerate's own save_state, uninterrupted: the final parameters and the folders left."""
    torch.set_num_threads(1)
    d = tmp_path_factory.mktemp("acc-plain")
    model = app.run(d, "accelerate", STEPS, resume=False)
    return {k: v.detach().clone() for k, v in model.state_dict().items()}, sorted(os.listdir(d / "checkpoints"))


def test_uninterrupted_matches_accelerate(tmp_path, reference):
    final, names = reference
    model = app.run(tmp_path, "zerostall", STEPS, resume=False)
    assert equal(model.state_dict(), final)
    assert sorted(os.listdir(tmp_path / "checkpoints")) == names == ["checkpoint_1", "checkpoint_2"]
    assert LocalTier(tmp_path / "checkpoints" / "checkpoint_2").steps() == [2]


@pytest.mark.parametrize("boundary", ["manifest:1", "publish:1", "manifest:2"])
def test_sigkill_during_a_save_then_load_state(tmp_path, reference, boundary):
    """A SIGKILL during the first save (before its commit; after it, before the rename) or a
    later one: checkpoints/ lists only committed checkpoints, load_state() resumes from the
    newest, the counter continues (Accelerate's own load_state leaves it at 0: the next save
    fails with 'already exists'), and the run ends bit-exactly (dropout: the RNG is restored)."""
    final, names = reference
    r = run_app("accelerate_app.py", tmp_path, "--steps", str(STEPS), timeout=240, ZS_KILL_AT=boundary)
    assert r.returncode == -9, r.stderr[-3000:]
    ckdir = tmp_path / "checkpoints"
    listed = sorted(os.listdir(ckdir)) if os.path.isdir(ckdir) else []
    assert listed == (["checkpoint_0"] if boundary == "manifest:2" else []), listed
    for n in listed:
        assert LocalTier(ckdir / n).steps() == [0]
    torch.set_num_threads(1)
    model = app.run(tmp_path, "zerostall", STEPS, resume=bool(listed))
    assert equal(model.state_dict(), final)
    assert sorted(os.listdir(ckdir)) == names
    assert os.listdir(tmp_path / ".zerostall-staging") == []


def test_export_writes_what_accelerates_load_state_reads(tmp_path, reference):
    """`zerostall export --format accelerate`: a save_state folder that Accelerate's own
    load_state() resumes from, to the same end (RNG states included)."""
    final, _ = reference
    torch.set_num_threads(1)
    app.run(tmp_path / "z", "zerostall", 8, resume=False)  # checkpoint_1 holds step 8
    out = tmp_path / "native" / "checkpoints" / "checkpoint_1"
    os.makedirs(out.parent)
    export("accelerate", tmp_path / "z" / "checkpoints" / "checkpoint_1", out)
    assert {"model.safetensors", "optimizer.bin", "scheduler.bin", "random_states_0.pkl",
            "custom_checkpoint_0.pkl"} <= set(os.listdir(out))
    model = app.run(tmp_path / "native", "accelerate", STEPS, resume=True)
    assert equal(model.state_dict(), final)


def test_a_save_state_pre_hook_writes_into_the_directory_it_is_given(tmp_path):
    """Accelerate hands ``register_save_state_pre_hook``'s hooks the directory being written, which
    exists then (Accelerate's own ``save_state`` creates it first): what a hook writes there is
    published with the checkpoint."""
    from accelerate.utils import ProjectConfiguration
    from zerostall.integrations.accelerate import ZerostallAccelerator

    acc = ZerostallAccelerator(cpu=True, project_config=ProjectConfiguration(
        project_dir=str(tmp_path), automatic_checkpoint_naming=True))
    acc.prepare(torch.nn.Linear(2, 2))

    def hook(models, weights, output_dir):
        with open(os.path.join(output_dir, "extra.json"), "w") as f:
            f.write("{}")

    acc.register_save_state_pre_hook(hook)
    final = acc.save_state()
    acc.end_training()
    with open(os.path.join(final, "extra.json")) as f:
        assert f.read() == "{}"
    assert LocalTier(final).steps() == [0]
