"""Hugging Face Trainer through zerostall: stop or SIGKILL mid-run, resume, and compare bit
for bit with an uninterrupted run and with the Trainer's own checkpointing."""

import os
import subprocess
import sys

import pytest
import torch

pytest.importorskip("transformers")

import zerostall  # noqa: E402
from zerostall.store.local import LocalTier  # noqa: E402
from tests.frameworks import HERE, app_env, export, run_app  # noqa: E402
from tests.helpers import equal, free_port  # noqa: E402
from zerostall.integrations.transformers import last_committed_checkpoint  # noqa: E402

import hf_app  # noqa: E402

STEPS = 12


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """The plain Trainer: uninterrupted, and stopped at 8 then resumed with its own checkpoints."""
    torch.set_num_threads(1)
    d = tmp_path_factory.mktemp("hf-plain")
    t = hf_app.make_trainer(d / "full", "hf", STEPS)
    t.train()
    final = hf_app.final_params(t)
    hf_app.make_trainer(d / "stopped", "hf", STEPS, callbacks=[hf_app.StopAt(8)]).train()
    t = hf_app.make_trainer(d / "stopped", "hf", STEPS)
    t.train(resume_from_checkpoint=True)
    assert equal(hf_app.final_params(t), final)  # the Trainer's own resume is exact here
    return final


def test_stop_and_resume_is_bit_identical(tmp_path, reference):
    torch.set_num_threads(1)
    t = hf_app.make_trainer(tmp_path, "zerostall", STEPS, callbacks=[hf_app.StopAt(8)])
    t.train()
    assert t.state.global_step == 8
    ck8 = tmp_path / "checkpoint-8"
    saved = zerostall.load(ck8)
    assert set(saved) == {"model", "optimizer", "scheduler", "rng", "trainer_state"}
    assert type(saved["trainer_state"]).__name__ == "TrainerState" and saved["trainer_state"].global_step == 8
    assert saved["scheduler"]["last_epoch"] == 8 and set(saved["rng"]) >= {"python", "numpy", "torch"}
    assert os.path.isfile(ck8 / "trainer_state.json")
    t = hf_app.make_trainer(tmp_path, "zerostall", STEPS)
    t.train(resume_from_checkpoint=True)
    assert equal(hf_app.final_params(t), reference)
    # save_total_limit=2: the newest two remain, each one committed zerostall step
    assert sorted(n for n in os.listdir(tmp_path) if n.startswith("checkpoint-")) == ["checkpoint-12", "checkpoint-8"]
    assert LocalTier(tmp_path / "checkpoint-12").steps() == [12]


def test_sigkill_mid_run_then_resume_with_the_mixin(tmp_path, reference):
    r = run_app("hf_app.py", tmp_path, "--trainer", "mixin", "--steps", str(STEPS), "--kill-at-step", "9", timeout=300)
    assert r.returncode == -9, r.stderr[-3000:]
    assert not os.path.exists(tmp_path / "final.pt")
    # a checkpoint cut short by a crash is skipped (HF's own get_last_checkpoint would pick it)
    os.makedirs(tmp_path / "checkpoint-99" / "step-99.partial")
    newest = last_committed_checkpoint(str(tmp_path))
    assert newest in (str(tmp_path / "checkpoint-8"), str(tmp_path / "checkpoint-4"))
    torch.set_num_threads(1)
    t = hf_app.make_trainer(tmp_path, "mixin", STEPS)
    t.train(resume_from_checkpoint=True)
    assert type(t).__mro__[2] is hf_app.CountingTrainer and hf_app.CountingTrainer.losses_computed > 0
    assert equal(hf_app.final_params(t), reference)


@pytest.mark.parametrize("boundary", ["manifest:1", "publish:1", "manifest:2"])
def test_get_last_checkpoint_after_a_sigkill_during_a_save(tmp_path, reference, boundary):
    """HF's own resume path (``get_last_checkpoint``, as HF's example scripts do it) after a
    SIGKILL during the first save (before its commit; after it, before the rename) and during
    a later one: it never names an uncommitted checkpoint, and the run resumes bit-exactly.
    (It named checkpoint-4/ holding only step-4.partial: "Can't find a valid checkpoint".)"""
    from transformers.trainer_utils import get_last_checkpoint
    r = run_app("hf_app.py", tmp_path, "--trainer", "zerostall", "--steps", str(STEPS), timeout=300,
                ZS_KILL_AT=boundary)
    assert r.returncode == -9, r.stderr[-3000:]
    last = get_last_checkpoint(str(tmp_path))
    assert last == (str(tmp_path / "checkpoint-4") if boundary == "manifest:2" else None), os.listdir(tmp_path)
    if last is not None:
        assert LocalTier(last).steps() == [4] and os.path.isfile(os.path.join(last, "trainer_state.json"))
    torch.set_num_threads(1)
    t = hf_app.make_trainer(tmp_path, "zerostall", STEPS)
    t.train(resume_from_checkpoint=last)
    assert equal(hf_app.final_params(t), reference)
    # the staged leftovers are gone; what HF lists is committed
    assert sorted(os.listdir(tmp_path)) == ["checkpoint-12", "checkpoint-8"]


def _retention_args(outdir, limit):
    from transformers import TrainingArguments
    return TrainingArguments(output_dir=str(outdir), max_steps=16, save_steps=4, eval_strategy="steps",
                             eval_steps=4, load_best_model_at_end=True, metric_for_best_model="eval_loss",
                             greater_is_better=True,  # the worse loss "wins": an early checkpoint
                             save_total_limit=limit, per_device_train_batch_size=4, learning_rate=1e-2,
                             report_to=[], use_cpu=True, disable_tqdm=True)


@pytest.mark.parametrize("limit", [1, 2])
def test_retention_with_load_best_model_at_end_matches_the_plain_trainer(tmp_path, limit):
    """save_total_limit with load_best_model_at_end: the same folders remain as with the plain
    Trainer (three stayed where it keeps two)."""
    from transformers import Trainer

    from zerostall.integrations.transformers import ZerostallTrainer
    torch.set_num_threads(1)
    left = {}
    for cls in (Trainer, ZerostallTrainer):
        out = tmp_path / cls.__name__
        t = cls(model=hf_app.model(), args=_retention_args(out, limit), train_dataset=hf_app.dataset(),
                eval_dataset=hf_app.dataset(8))
        t.train()
        left[cls] = sorted(os.listdir(out)), os.path.basename(t.state.best_model_checkpoint)
    assert left[ZerostallTrainer] == left[Trainer]
    assert len(left[Trainer][0]) == limit and left[Trainer][1] != "checkpoint-16"  # the best is an older one


def test_load_best_model_at_end_reads_the_zerostall_checkpoint(tmp_path):
    from transformers import TrainingArguments

    from zerostall.integrations.transformers import ZerostallTrainer
    torch.set_num_threads(1)
    args = TrainingArguments(output_dir=str(tmp_path), max_steps=8, save_steps=4, eval_strategy="steps",
                             eval_steps=4, load_best_model_at_end=True, metric_for_best_model="eval_loss",
                             greater_is_better=True,  # the worse loss "wins": not the final weights
                             save_total_limit=1, per_device_train_batch_size=4, learning_rate=1e-2,
                             report_to=[], use_cpu=True, disable_tqdm=True)
    t = ZerostallTrainer(model=hf_app.model(), args=args, train_dataset=hf_app.dataset(),
                         eval_dataset=hf_app.dataset(8))
    t.train()
    best = t.state.best_model_checkpoint
    assert best is not None and os.path.isdir(best)
    # save_total_limit=1 still keeps the best checkpoint besides the newest one
    assert sorted(os.listdir(tmp_path)) == sorted({os.path.basename(best), "checkpoint-8"})
    assert equal(hf_app.final_params(t), zerostall.load(best)["model"])


def test_ddp_two_gloo_processes_resume_exactly(tmp_path):
    import json
    env = app_env()
    r = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", f"--master_port={free_port()}",
                        os.path.join(HERE, "hf_app.py"), str(tmp_path), "--ddp"], env=env, timeout=300,
                       capture_output=True, text=True)
    assert r.returncode == 0, r.stderr[-3000:]
    docs = [json.load(open(tmp_path / f"ddp-rank{i}.json")) for i in (0, 1)]
    assert [d["world"] for d in docs] == [2, 2] and all(d["step"] == 12 for d in docs)
    assert all(d["equal"] for d in docs)
    ck = tmp_path / "stopped" / "checkpoint-8"
    files = sorted(os.listdir(ck / "step-8"))
    assert [f for f in files if f.startswith("rank-")] and len([f for f in files if f.startswith("rank-")]) == 2


def test_a_training_error_is_not_masked_by_a_failed_checkpoint(tmp_path, monkeypatch):
    """train() raising while a save fails too: the caller gets the training's error (the
    checkpoint failure logged and noted on it), not the checkpoint's (it used to replace it:
    the finally block's zerostall_wait raised over the training error)."""
    from transformers import TrainerCallback

    from zerostall.errors import ZerostallError

    class Boom(TrainerCallback):
        def on_step_end(self, args, state, control, **kw):
            if state.global_step == 5:  # after the save of step 4 was issued
                raise RuntimeError("training blew up at step 5")

    def fail(name):
        if name == "manifest":
            raise OSError(5, "Input/output error (injected)")

    monkeypatch.setattr(LocalTier, "_hook", staticmethod(fail))  # every commit fails (the seam)
    torch.set_num_threads(1)
    t = hf_app.make_trainer(tmp_path, "zerostall", 8, callbacks=[Boom()])
    with pytest.raises(RuntimeError, match="training blew up at step 5") as ei:
        t.train()
    assert not isinstance(ei.value, ZerostallError)
    assert any("finishing the checkpoints also failed" in n for n in getattr(ei.value, "__notes__", []))
    monkeypatch.setattr(LocalTier, "_hook", None)
    t2 = hf_app.make_trainer(tmp_path / "ok", "zerostall", 4)  # and without a training error, it is raised
    monkeypatch.setattr(LocalTier, "_hook", staticmethod(fail))
    with pytest.raises(ZerostallError):
        t2.train()


def test_export_writes_what_the_plain_trainer_resumes_from(tmp_path, reference):
    """`zerostall export --format transformers` of a ZerostallTrainer checkpoint: the plain
    Trainer resumes from the folder (model.safetensors, optimizer.pt, scheduler.pt,
    rng_state.pth, trainer_state.json) and ends bit-exactly (dropout: the RNG state too)."""
    torch.set_num_threads(1)
    hf_app.make_trainer(tmp_path / "z", "zerostall", STEPS, callbacks=[hf_app.StopAt(8)]).train()
    out = tmp_path / "plain" / "checkpoint-8"
    os.makedirs(out.parent)
    export("transformers", tmp_path / "z" / "checkpoint-8", out)
    assert {"model.safetensors", "optimizer.pt", "scheduler.pt", "rng_state.pth", "trainer_state.json"} <= set(os.listdir(out))
    t = hf_app.make_trainer(tmp_path / "plain", "hf", STEPS)
    t.train(resume_from_checkpoint=str(out))
    assert equal(hf_app.final_params(t), reference)
