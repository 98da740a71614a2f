"""Lightning with ZerostallCheckpointIO: fit, SIGKILL, resume, compared bit for bit with
Lightning's own checkpointing; Namespace hyper-parameters; DDP with 2 gloo processes."""

import argparse
import os

import pytest
import torch

pytest.importorskip("lightning")

import zerostall  # noqa: E402
from zerostall.store.local import LocalTier  # noqa: E402
from tests.frameworks import export, run_app  # noqa: E402
from tests.helpers import equal, free_port  # noqa: E402
from zerostall.integrations.lightning import (  # noqa: E402
    ZerostallCheckpointIO, is_zerostall_checkpoint, load_from_checkpoint)

import lightning_app as app  # noqa: E402

EPOCHS = 4


def run_lightning(outdir, *args, timeout=240):
    return run_app("lightning_app.py", outdir, *args, timeout=timeout, PL_DISABLE_FORK="1", MASTER_ADDR="127.0.0.1",
                   MASTER_PORT=str(free_port()))


def fit_in_process(outdir, io, epochs, resume=None):
    torch.set_num_threads(1)
    trainer, cb = app.make_trainer(str(outdir), io, epochs)
    model = app.TinyModel(argparse.Namespace(seed=1, note="hparams as a Namespace"))
    # Lightning's own loader refuses the Namespace under weights_only: it must unpickle
    trainer.fit(model, app.data(), ckpt_path=resume, weights_only=False if io == "torch" else None)
    return model, trainer, cb


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """Lightning's own checkpointing (torch.save): uninterrupted, and resumed from epoch 1."""
    d = tmp_path_factory.mktemp("pl-torch")
    model, _, cb = fit_in_process(d, "torch", EPOCHS)
    final = {k: v.clone() for k, v in model.state_dict().items()}
    fit_in_process(d / "half", "torch", 2)
    resumed, _, _ = fit_in_process(d / "resumed", "torch", EPOCHS,
                                   resume=str(d / "half" / "ckpts" / "epoch=1-step=16.ckpt"))
    assert equal(resumed.state_dict(), final)  # Lightning's own resume is exact here
    return final, sorted(os.listdir(d / "ckpts")), d


def test_fit_topk_last_and_resume_match_lightning(tmp_path, reference):
    final, names, ref_dir = reference
    model, trainer, cb = fit_in_process(tmp_path, "zerostall", EPOCHS)
    assert equal(model.state_dict(), final)
    # the same top-k/last files as Lightning's own run, each a verified zerostall checkpoint
    assert sorted(os.listdir(tmp_path / "ckpts")) == names
    assert len(names) == 3 and "last.ckpt" in names
    for n in names:
        p = tmp_path / "ckpts" / n
        assert is_zerostall_checkpoint(p) and len(LocalTier(p).steps()) == 1
    last = zerostall.load(tmp_path / "ckpts" / "last.ckpt")
    assert equal(last["state_dict"], final)
    assert last["hyper_parameters"]["args"] == argparse.Namespace(seed=1, note="hparams as a Namespace")
    assert last["epoch"] == EPOCHS - 1 and last["global_step"] == 8 * EPOCHS
    ref = torch.load(ref_dir / "ckpts" / "last.ckpt", weights_only=False)
    assert equal(last["optimizer_states"], ref["optimizer_states"])
    assert last["lr_schedulers"] == ref["lr_schedulers"] and last["loops"] == ref["loops"]


def test_resume_with_ckpt_path_and_load_from_checkpoint(tmp_path, reference):
    final, _, _ = reference
    fit_in_process(tmp_path, "zerostall", 2)
    first = tmp_path / "ckpts" / "epoch=1-step=16.ckpt"
    assert is_zerostall_checkpoint(first)
    model, _, _ = fit_in_process(tmp_path / "resumed", "zerostall", EPOCHS, resume=str(first))
    assert equal(model.state_dict(), final)
    loaded = load_from_checkpoint(app.TinyModel, tmp_path / "resumed" / "ckpts" / "last.ckpt")
    assert isinstance(loaded.hparams.args, argparse.Namespace) and loaded.hparams.args.seed == 1
    assert equal(loaded.state_dict(), final)
    # the plain-Lightning loader still works on torch.save files through the same helper
    ref = load_from_checkpoint(app.TinyModel, reference[2] / "ckpts" / "last.ckpt", weights_only=False)
    assert isinstance(ref, app.TinyModel) and equal(ref.state_dict(), final)


def test_sigkill_mid_run_then_resume_is_exact(tmp_path, reference):
    final, _, _ = reference
    r = run_lightning(tmp_path, "--io", "zerostall", "--epochs", str(EPOCHS), "--kill-after-epoch", "1")
    assert r.returncode == -9, r.stderr[-3000:]
    last = tmp_path / "ckpts" / "last.ckpt"
    assert is_zerostall_checkpoint(last)
    assert zerostall.load(last)["epoch"] in (0, 1)  # epoch 1's save may have been in flight
    model, _, _ = fit_in_process(tmp_path, "zerostall", EPOCHS, resume=str(last))
    assert equal(model.state_dict(), final)
    assert not any(n.endswith("zerostall-removing") for n in os.listdir(tmp_path / "ckpts"))


def params(sd):
    return {k: v for k, v in sd.items() if "running" not in k and "num_batches" not in k}


def test_ddp_two_gloo_processes(tmp_path):
    r = run_lightning(tmp_path, "--io", "zerostall", "--epochs", "2", "--ddp")
    assert r.returncode == 0, r.stderr[-3000:]
    f0, f1 = (torch.load(tmp_path / f"final-rank{i}.pt") for i in (0, 1))
    assert equal(params(f0), params(f1))  # DDP replicas (BatchNorm statistics are per rank)
    last = zerostall.load(tmp_path / "ckpts" / "last.ckpt")
    assert equal(last["state_dict"], f0) and last["global_step"] == 8
    # resume under DDP from epoch 0 (every rank loads the rank-0 checkpoint) to the same end
    r = run_lightning(tmp_path / "resumed", "--io", "zerostall", "--epochs", "2", "--ddp",
                "--resume", str(tmp_path / "ckpts" / "epoch=0-step=4.ckpt"))
    assert r.returncode == 0, r.stderr[-3000:]
    assert equal(torch.load(tmp_path / "resumed" / "final-rank0.pt"), f0)
    assert equal(params(torch.load(tmp_path / "resumed" / "final-rank1.pt")), params(f0))


def test_options_and_errors(tmp_path):
    with pytest.raises(zerostall.errors.ConfigError, match="remote"):
        ZerostallCheckpointIO(remote="s3://b/p")
    with pytest.raises(zerostall.errors.ConfigError, match="unknown"):
        ZerostallCheckpointIO(no_such_option=1)
    io = ZerostallCheckpointIO(wait_staged=True)
    state = {"state_dict": {"w": torch.ones(3)}, "global_step": 5, "hp": argparse.Namespace(a=1)}
    io.save_checkpoint(state, tmp_path / "a.ckpt")
    io.save_checkpoint({**state, "global_step": 5}, tmp_path / "a.ckpt")  # same path, same step: a new step
    io.teardown()
    assert LocalTier(tmp_path / "a.ckpt").steps() == [6]
    assert io.load_checkpoint(tmp_path / "a.ckpt")["hp"] == argparse.Namespace(a=1)
    io.remove_checkpoint(tmp_path / "a.ckpt")
    assert not os.path.exists(tmp_path / "a.ckpt") and os.listdir(tmp_path) == []
    # a torch.save file under the same name is set aside, and removed once the new save is durable
    torch.save({"old": 1}, tmp_path / "b.ckpt")
    os.makedirs(tmp_path / ".c.ckpt.zerostall-removing")  # left by a crashed run
    io = ZerostallCheckpointIO()
    io.save_checkpoint(state, tmp_path / "b.ckpt")
    io.teardown()
    assert sorted(os.listdir(tmp_path)) == ["b.ckpt"] and is_zerostall_checkpoint(tmp_path / "b.ckpt")


def test_save_last_as_a_link(tmp_path):
    import lightning as L
    from lightning.pytorch.callbacks import ModelCheckpoint
    torch.set_num_threads(1)

    def run(epochs, resume=None):
        cb = ModelCheckpoint(dirpath=tmp_path, monitor="train_loss", save_top_k=1, save_last="link")
        trainer = L.Trainer(max_epochs=epochs, accelerator="cpu", logger=False, enable_progress_bar=False,
                            enable_model_summary=False, plugins=[ZerostallCheckpointIO()], callbacks=[cb])
        model = app.TinyModel(argparse.Namespace(seed=1))
        trainer.fit(model, app.data(), ckpt_path=resume)
        return model

    run(2)
    last = tmp_path / "last.ckpt"
    assert os.path.islink(last) and is_zerostall_checkpoint(last)
    assert zerostall.load(last)["epoch"] == 1
    model = run(3, resume="last")
    assert equal(zerostall.load(last)["state_dict"], model.state_dict())
    assert zerostall.load(last)["epoch"] == 2


def test_a_failed_save_over_a_torch_save_file_keeps_the_file(tmp_path):
    """The torch.save file a save replaces is set aside, never deleted before the new
    checkpoint commits: a save that fails puts it back."""
    path = tmp_path / "last.ckpt"
    torch.save({"old": torch.ones(3)}, path)
    io = ZerostallCheckpointIO()

    class NotStorable:
        pass

    with pytest.raises(zerostall.errors.UnsupportedStateError):
        io.save_checkpoint({"state_dict": {"w": torch.zeros(3)}, "global_step": 1, "x": NotStorable()}, path)
    io.teardown()
    assert os.path.isfile(path) and os.listdir(tmp_path) == ["last.ckpt"]
    assert torch.equal(torch.load(path, weights_only=True)["old"], torch.ones(3))
    io.save_checkpoint({"state_dict": {"w": torch.zeros(3)}, "global_step": 1}, path)  # then a good one
    io.teardown()
    assert os.listdir(tmp_path) == ["last.ckpt"] and is_zerostall_checkpoint(path)


def test_a_path_removed_twice_keeps_the_first_until_the_saves_are_durable(tmp_path):
    """remove -> save -> remove of one path while another save is in flight: the first removed
    checkpoint is deleted only once that save is durable, never by the second removal."""
    import threading

    io = ZerostallCheckpointIO(wait_staged=True)
    state = {"state_dict": {"w": torch.ones(3)}, "global_step": 1}
    a = tmp_path / "a.ckpt"
    io.save_checkpoint(state, a)
    io.teardown()
    go = threading.Event()

    class InFlight:  # a save of another path that is not durable yet
        def done(self):
            return go.is_set()

        def wait(self, timeout=None):
            return go.wait(timeout)

        def exception(self, timeout=None):
            return None

    io.handles.append(InFlight())
    io.remove_checkpoint(a)
    first = [n for n in os.listdir(tmp_path) if n.endswith(".zerostall-removing")]
    assert len(first) == 1
    io.save_checkpoint({**state, "global_step": 2}, a)
    io.handles.append(InFlight())
    io.remove_checkpoint(a)
    aside = [n for n in os.listdir(tmp_path) if n.endswith(".zerostall-removing")]
    assert first[0] in aside and len(aside) == 2  # the first removed checkpoint is still there
    assert is_zerostall_checkpoint(tmp_path / first[0])
    go.set()
    io.teardown()
    assert os.listdir(tmp_path) == []


def test_a_replacing_save_that_fails_later_puts_the_file_back(tmp_path, monkeypatch):
    """A save over a torch.save file that fails in the background (here: every commit fails,
    the seam) puts the file back at teardown; it used to stay set aside as
    .NAME.zerostall-removing, which the next run's start-up cleanup deleted: the previous good
    checkpoint was lost."""
    path = tmp_path / "last.ckpt"
    torch.save({"old": torch.ones(3)}, path)

    def fail(name):
        if name == "manifest":
            raise OSError(5, "Input/output error (injected)")

    monkeypatch.setattr(LocalTier, "_hook", staticmethod(fail))
    io = ZerostallCheckpointIO()
    io.save_checkpoint({"state_dict": {"w": torch.zeros(3)}, "global_step": 1}, path)
    with pytest.raises(zerostall.errors.ZerostallError):
        io.teardown()
    monkeypatch.setattr(LocalTier, "_hook", None)
    assert os.listdir(tmp_path) == ["last.ckpt"] and os.path.isfile(path)
    # the next run: its start-up cleanup of the directory keeps it, and a good save replaces it
    io = ZerostallCheckpointIO()
    io.save_checkpoint({"state_dict": {"w": torch.zeros(3)}, "global_step": 1}, tmp_path / "other.ckpt")
    io.teardown()
    assert torch.equal(torch.load(path, weights_only=True)["old"], torch.ones(3))


def test_a_crash_during_a_replacing_save_puts_the_file_back_next_run(tmp_path):
    """The process died while a save over a torch.save file was in flight: the file is still
    set aside and the path holds an uncommitted directory. The next run puts the file back."""
    path = tmp_path / "last.ckpt"
    torch.save({"old": torch.ones(3)}, tmp_path / ".last.ckpt.zerostall-replaced")
    os.makedirs(path / "step-1.partial")
    committed = tmp_path / "good.ckpt"  # and one whose replacing save did commit: the old file goes
    zerostall.save(str(committed), {"w": torch.ones(2)}, step=1)
    torch.save({"older": 1}, tmp_path / ".good.ckpt.zerostall-replaced")
    io = ZerostallCheckpointIO()
    io.save_checkpoint({"state_dict": {"w": torch.zeros(3)}, "global_step": 1}, tmp_path / "other.ckpt")
    io.teardown()
    assert sorted(os.listdir(tmp_path)) == ["good.ckpt", "last.ckpt", "other.ckpt"]
    assert torch.equal(torch.load(path, weights_only=True)["old"], torch.ones(3))


def test_resuming_after_a_crash_during_a_replacing_save_loads_the_previous_checkpoint(tmp_path):
    """The process died while a save replaced last.ckpt (a link to a zerostall checkpoint, as
    save_last="link" makes it): the link is set aside and the path holds an uncommitted
    directory. The next run resumes before it saves: load_checkpoint puts the link back and
    loads it (it raised CheckpointNotFound on the uncommitted directory; only a save put the
    link back)."""
    best = tmp_path / "epoch=1-step=16.ckpt"
    zerostall.save(str(best), {"state_dict": {"w": torch.ones(2)}, "epoch": 1}, step=16)
    os.symlink(best.name, tmp_path / ".last.ckpt.zerostall-replaced")
    os.makedirs(tmp_path / "last.ckpt" / "step-17.partial")
    io = ZerostallCheckpointIO()
    got = io.load_checkpoint(tmp_path / "last.ckpt")
    io.teardown()
    assert got["epoch"] == 1 and torch.equal(got["state_dict"]["w"], torch.ones(2))
    assert os.path.islink(tmp_path / "last.ckpt")
    assert sorted(os.listdir(tmp_path)) == ["epoch=1-step=16.ckpt", "last.ckpt"]


@pytest.mark.parametrize("boundary", ["manifest:1:last.ckpt", "publish:2", "manifest:2:last.ckpt"])
def test_a_sigkill_during_a_save_of_last_never_blocks_ckpt_path_last(tmp_path, reference, boundary):
    """SIGKILL during the first save of last.ckpt (before its commit; after it, before the
    rename) and during a later one: fit(ckpt_path="last") resumes (or starts over when no
    last.ckpt was committed) and ends bit-exactly where an uninterrupted run does. (The first
    save left an empty last.ckpt/ and every restart raised CheckpointNotFound.)"""
    final, _, _ = reference
    r = run_app("lightning_app.py", tmp_path, "--io", "zerostall", "--epochs", str(EPOCHS), timeout=240,
                ZS_KILL_AT=boundary)
    assert r.returncode == -9, r.stderr[-3000:]
    last = tmp_path / "ckpts" / "last.ckpt"
    if boundary.startswith("manifest:2"):  # the first save of last.ckpt (epoch 0) is committed
        assert is_zerostall_checkpoint(last) and zerostall.load(last)["epoch"] == 0
    else:
        assert not os.path.lexists(last), os.listdir(tmp_path / "ckpts")
    model, _, _ = fit_in_process(tmp_path, "zerostall", EPOCHS, resume="last")
    assert equal(model.state_dict(), final)
    names = os.listdir(tmp_path / "ckpts")
    assert "last.ckpt" in names and not [n for n in names if n.startswith(".")], names
    assert zerostall.load(last)["epoch"] == EPOCHS - 1


def test_a_run_saved_natively_continues_with_the_plugin(tmp_path, reference):
    """A run begun with Lightning's own checkpointing (last.ckpt a torch.save file) continues
    with the plugin: the first resume reads the native file (weights-only), the next save of
    last.ckpt replaces it with a zerostall checkpoint. (It raised ConfigError: 'is a file')."""
    final, _, _ = reference
    fit_in_process(tmp_path, "torch", 2)  # Lightning's own checkpointing, then the plugin
    assert os.path.isfile(tmp_path / "ckpts" / "last.ckpt")
    model, _, _ = fit_in_process(tmp_path, "zerostall", EPOCHS, resume="last")
    assert equal(model.state_dict(), final)
    last = tmp_path / "ckpts" / "last.ckpt"
    assert is_zerostall_checkpoint(last) and zerostall.load(last)["epoch"] == EPOCHS - 1
    assert not [n for n in os.listdir(tmp_path / "ckpts") if n.startswith(".")]


class _Planted:
    """Unpickling this (unrestricted) would create the marker file: code would run."""

    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return (open, (self.marker, "w"))


def test_a_native_checkpoint_is_read_weights_only(tmp_path):
    marker = tmp_path / "code-ran"
    bad = tmp_path / "bad.ckpt"
    torch.save({"state_dict": {"w": torch.ones(2)}, "hyper_parameters": {"x": _Planted(str(marker))}}, bad)
    io = ZerostallCheckpointIO()
    with pytest.raises(zerostall.errors.ConfigError, match="bad.ckpt.*weights-only.*add_safe_globals"):
        io.load_checkpoint(bad)
    assert not marker.exists()
    good = tmp_path / "good.ckpt"
    torch.save({"state_dict": {"w": torch.ones(2)}, "hyper_parameters": {"args": argparse.Namespace(seed=3)}}, good)
    got = io.load_checkpoint(good)
    assert got["hyper_parameters"]["args"] == argparse.Namespace(seed=3) and torch.equal(got["state_dict"]["w"], torch.ones(2))
    io.teardown()


def test_rng_state_is_saved_and_restored(tmp_path):
    """Dropout draws from the global RNG: stopped after epoch 1 and resumed with
    ckpt_path="last" (in a process whose RNG has moved on), the run ends bit-exactly where an
    uninterrupted one does, because the checkpoint holds the RNG state and loading restores it."""
    import lightning as L

    def fit(outdir, epochs, resume=None):
        torch.set_num_threads(1)
        trainer, _ = app.make_trainer(str(outdir), "zerostall", epochs)
        torch.manual_seed(123)
        model = app.DropoutModel(argparse.Namespace(seed=1))
        L.seed_everything(7) if resume is None else torch.rand(5)  # a resumed process's RNG has moved on
        trainer.fit(model, app.data(), ckpt_path=resume)
        return model

    full = fit(tmp_path / "full", EPOCHS)
    fit(tmp_path / "stopped", 2)
    saved = zerostall.load(tmp_path / "stopped" / "ckpts" / "last.ckpt")
    assert set(saved["zerostall_rng"]) >= {"python", "numpy", "torch"}
    resumed = fit(tmp_path / "stopped", EPOCHS, resume="last")
    assert equal(resumed.state_dict(), full.state_dict())


def test_export_writes_what_lightnings_own_checkpointing_resumes_from(tmp_path, reference):
    """`zerostall export --format lightning` of last.ckpt: a torch.save file that Lightning
    without the plugin resumes from, to the same end."""
    final, _, _ = reference
    fit_in_process(tmp_path / "z", "zerostall", 2)
    os.makedirs(tmp_path / "native" / "ckpts")
    out = tmp_path / "native" / "ckpts" / "epoch-1.ckpt"
    export("lightning", tmp_path / "z" / "ckpts" / "last.ckpt", out)
    assert os.path.isfile(out) and "zerostall_rng" not in torch.load(out, weights_only=False)
    model, _, _ = fit_in_process(tmp_path / "native", "torch", EPOCHS, resume=str(out))
    assert equal(model.state_dict(), final)


def test_putting_the_file_back_holds_the_root_while_it_removes_the_failed_save(tmp_path, monkeypatch):
    """The next run removes the uncommitted directory a crash left at the path, then puts the
    set-aside file back: during the removal it holds that root's lock, so a writer starting
    there meanwhile is refused instead of losing its files (a second process probes the lock
    at the moment the removal begins)."""
    import shutil
    import subprocess
    import sys
    path = tmp_path / "last.ckpt"
    torch.save({"old": torch.ones(3)}, tmp_path / ".last.ckpt.zerostall-replaced")
    os.makedirs(path / "step-1.partial")
    probe = ("import sys\nfrom zerostall.extend import RootLock\nfrom zerostall.errors import RootLockedError\n"
             "try:\n    RootLock(sys.argv[1]).acquire(0.0)\nexcept RootLockedError:\n    print('held')\n"
             "else:\n    print('free')\n")
    seen, real = [], shutil.rmtree

    def rmtree(p, *a, **kw):
        if os.fspath(p) == str(path):
            seen.append(subprocess.run([sys.executable, "-c", probe, str(path)], capture_output=True, text=True,
                                       check=True).stdout.strip())
        return real(p, *a, **kw)
    monkeypatch.setattr(shutil, "rmtree", rmtree)
    io = ZerostallCheckpointIO()
    io.save_checkpoint({"state_dict": {"w": torch.zeros(3)}, "global_step": 1}, tmp_path / "other.ckpt")
    io.teardown()
    assert seen == ["held"]
    assert torch.equal(torch.load(path, weights_only=True)["old"], torch.ones(3))


def test_a_put_back_refused_by_a_live_writer_names_where_the_previous_checkpoint_stays(tmp_path, caplog):
    """Found by adv3: the put-back left alone because a live writer holds the path's root lock
    must still tell the user where the previous checkpoint is (the set-aside file)."""
    from zerostall.extend import RootLock
    path = tmp_path / "last.ckpt"
    aside = tmp_path / ".last.ckpt.zerostall-replaced"
    torch.save({"old": torch.ones(3)}, aside)
    os.makedirs(path / "step-1.partial")
    holder = RootLock(str(path))
    holder.acquire(0.0)  # a live writer there
    try:
        io = ZerostallCheckpointIO()
        with caplog.at_level("WARNING", logger="zerostall"):
            io.save_checkpoint({"state_dict": {"w": torch.zeros(3)}, "global_step": 1}, tmp_path / "other.ckpt")
            io.teardown()
    finally:
        holder.release()
    assert any(str(aside) in r.getMessage() and str(path) in r.getMessage() for r in caplog.records), caplog.text
    assert aside.exists() and (path / "step-1.partial").exists()
