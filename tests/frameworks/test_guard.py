"""guard() on wrapped optimizers (Accelerate, Lightning) and with closures.

A save is held "not yet staged" by a job whose ``staged`` event the test controls (the seam:
``Checkpointer._inflight``, its ``status.staged``), so the order of events is checked without timing.
"""

import os
import threading
import types

import pytest
import torch

import zerostall
from zerostall.integrations._common import is_committed
from zerostall.saving.job import SaveStatus

from tests.helpers import clone, equal


def _pending(ck):
    status = SaveStatus()
    status.mark_queued()
    status.done.set()  # Checkpointer.wait()/close() must not wait for it
    job = types.SimpleNamespace(status=status, source=types.SimpleNamespace(reads=lambda storages, staged: True),
                                step=-1)
    ck._inflight.append(job)
    return job


def _model_opt():
    torch.manual_seed(0)
    model = torch.nn.Linear(8, 4)
    return model, torch.optim.SGD(model.parameters(), lr=0.1)


def _step_in_thread(fn):
    done = threading.Event()
    t = threading.Thread(target=lambda: (fn(), done.set()), daemon=True)
    t.start()
    return t, done


def _check_step_waits(ck, model, step_fn):
    job = _pending(ck)
    before = clone(model.state_dict())
    t, done = _step_in_thread(step_fn)
    assert not done.wait(0.3)  # held by the guard: parameters untouched
    assert equal(model.state_dict(), before)
    job.status.staged.set()
    t.join(10)
    assert done.is_set() and not equal(model.state_dict(), before)
    ck._inflight.remove(job)


def test_guard_accelerate_optimizer(ckdir):
    accelerate = pytest.importorskip("accelerate")
    model, opt = _model_opt()
    acc = accelerate.Accelerator(cpu=True)
    model, aopt = acc.prepare(model, opt)
    assert type(aopt).__name__ == "AcceleratedOptimizer"
    model(torch.randn(2, 8)).sum().backward()
    with zerostall.Checkpointer(ckdir) as ck:
        ck.guard(aopt)
        _check_step_waits(ck, model, aopt.step)
        # the wrapper is also saved and loaded as its state dict
        ck.save(1, {"model": model, "optim": aopt}).result()
    model2, opt2 = _model_opt()
    _, aopt2 = acc.prepare(model2, opt2)
    zerostall.load(ckdir, {"model": model2, "optim": aopt2})
    assert equal(model2.state_dict(), model.state_dict())


def test_guard_lightning_optimizer(ckdir):
    pytest.importorskip("lightning")
    from lightning.pytorch.core.optimizer import LightningOptimizer
    model, opt = _model_opt()
    lopt = LightningOptimizer(opt)
    model(torch.randn(2, 8)).sum().backward()
    with zerostall.Checkpointer(ckdir) as ck:
        ck.guard(lopt)
        _check_step_waits(ck, model, opt.step)


@pytest.mark.parametrize("as_kwarg", [False, True])
def test_guard_with_closure_waits_after_forward_backward(ckdir, as_kwarg):
    model, opt = _model_opt()
    seen = []
    with zerostall.Checkpointer(ckdir) as ck:
        ck.guard(opt)
        job = _pending(ck)
        before = clone(model.state_dict())
        in_closure = threading.Event()

        def closure():
            opt.zero_grad()
            loss = model(torch.randn(2, 8, generator=torch.Generator().manual_seed(1))).sum()
            loss.backward()
            seen.append(job.status.staged.is_set())
            in_closure.set()
            return loss

        t, done = _step_in_thread(lambda: opt.step(closure=closure) if as_kwarg else opt.step(closure))
        assert in_closure.wait(10)  # forward/backward ran while the snapshot was in flight
        assert not done.wait(0.3) and equal(model.state_dict(), before)
        job.status.staged.set()
        t.join(10)
        assert done.is_set() and seen == [False] and not equal(model.state_dict(), before)
        ck._inflight.remove(job)


def test_guard_rejects_non_optimizers(ckdir):
    with zerostall.Checkpointer(ckdir) as ck:
        with pytest.raises(zerostall.errors.ConfigError, match="torch.optim.Optimizer"):
            ck.guard(object())


def test_state_guard_holds_only_the_forward_of_modules_whose_buffers_are_copied(ckdir):
    from zerostall.integrations._common import StateGuard
    bn, lin = torch.nn.BatchNorm1d(4), torch.nn.Linear(4, 4)
    guard = StateGuard()
    with zerostall.Checkpointer(ckdir) as ck:
        job = _pending(ck)
        try:
            guard.track(ck, list(bn.state_dict().values()))
            lin(torch.randn(2, 4))  # no buffer being copied: runs at once
            before = bn.running_mean.clone()
            t, done = _step_in_thread(lambda: bn(torch.randn(3, 4)))
            assert not done.wait(0.3) and torch.equal(bn.running_mean, before)
            job.status.staged.set()
            t.join(10)
            assert done.is_set() and not torch.equal(bn.running_mean, before)
            bn(torch.randn(3, 4))  # nothing pending: the forward hook removes itself
            assert guard._fwd_hook is None
        finally:
            ck._inflight.remove(job)
            guard.close()


# ------------------------------------------------------------------------------------------------
# ``is_committed``: what the integrations take for a resumable checkpoint directory.

def test_a_partial_with_its_manifest_written_is_not_committed(tmp_path):
    # SIGKILL between the manifest write and the rename leaves exactly this on disk
    part = tmp_path / "checkpoint-8" / "step-8.partial"
    os.makedirs(part)
    (part / "manifest.json").write_bytes(b"{}")
    assert not is_committed(tmp_path / "checkpoint-8")
    assert not is_committed(tmp_path / "missing")


def test_a_committed_step_is_committed(tmp_path):
    zerostall.save(tmp_path / "checkpoint-4", {"w": torch.arange(4.0)}, 4)
    assert is_committed(tmp_path / "checkpoint-4")


def test_recover_staged_holds_the_root_lock_while_removing(tmp_path, monkeypatch):
    """recover_staged keeps the staged entry's root lock until it is removed: a writer starting
    there while the removal runs is refused instead of losing its files."""
    import re

    from zerostall.errors import RootLockedError
    from zerostall.extend import RootLock
    from zerostall.integrations import _common

    staged = tmp_path / ".staged-ckpt-1"
    staged.mkdir()
    (staged / "shard.bin").write_bytes(b"x")
    probes = []
    real_discard = _common.discard

    def probing_discard(path):
        probe = RootLock(path)
        try:
            probe.acquire(0.0)
        except RootLockedError:
            probes.append("refused")
        else:
            probes.append("taken")
            probe.release()
        real_discard(path)

    monkeypatch.setattr(_common, "discard", probing_discard)
    _common.recover_staged(str(tmp_path), re.compile(r"^\.staged-(.+)$"))
    assert probes == ["refused"]
    assert not staged.exists()


def test_next_step_moves_past_a_committed_step_0(ckdir):
    """A path saved twice gets a new step, also when the step committed there is 0."""
    from zerostall.integrations._common import next_step

    with zerostall.Checkpointer(ckdir) as ck:
        ck.save(0, {"w": torch.zeros(2)}).wait()
        assert next_step(ck, 0) == 1


def test_tensors_of_finds_tensors_inside_dict_and_list_subclasses():
    """Found by adv3: a68269c took the guarded tensors from torch's tree_leaves, which treats a
    dict subclass (e.g. a framework's AttributeDict) as a leaf, so its tensors went unguarded:
    the forward could change them while the snapshot copied them."""
    from zerostall.integrations._common import tensors_of

    class Attrs(dict):
        pass

    class Rows(list):
        pass

    a, b, c = torch.ones(2), torch.zeros(3), torch.arange(4.0)
    found = tensors_of({"x": Attrs(w=a, nested={"v": Rows([b])}), "y": (c, 1, "s")})
    assert sorted(t.data_ptr() for t in found) == sorted(t.data_ptr() for t in (a, b, c))
