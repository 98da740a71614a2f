"""More CUDA paths (skipped without a GPU): the registered pool growing and swapping, saves
overlapping in the ring, in-place loads into CUDA models and optimizers, map_location forms,
incremental checks of device memory, DCP async_save, Lightning's CheckpointIO.

Written without a device at hand: small tensors, no timing, every value compared bit for bit.
"""

import pytest
import torch

import zerostall
from zerostall.saving import pool as zpool

pytestmark = [pytest.mark.gpu, pytest.mark.timeout(120)]

MiB = 1 << 20


def _fresh_pool():
    """Start from no staging pool, so a test's budget and block size apply."""
    zpool.release_now()


def _cfg(budget, block, **kw):
    return zerostall.CheckpointConfig(staging=zerostall.StagingConfig(budget_bytes=budget, block_bytes=block), **kw)


def test_registered_pool_grows_and_swaps_its_reservation(ckdir, monkeypatch):
    """A small CUDA state, then a larger one than the reservation: the pool swaps to a new
    reservation (unregistering the old one before unmapping it) and registers the new one; both
    steps come back bit-exact."""
    _fresh_pool()
    monkeypatch.setattr(zpool, "RESERVE_MIN_BYTES", 32 * MiB)
    small = {"a": torch.randn(2 * MiB, device="cuda")}  # 8 MiB
    large = {"a": small["a"] * 2, "b": torch.randn(12 * MiB, device="cuda")}  # 56 MiB
    want = [{k: v.cpu().clone() for k, v in s.items()} for s in (small, large)]
    with zerostall.Checkpointer(ckdir, _cfg(256 * MiB, 4 * MiB)) as ck:
        assert ck.save(1, small).result().ok
        first = zpool.current().arena
        assert first.cuda_registered and first.cuda_pinned_bytes > 0 and first.cuda_error is None
        ck.prepare(large, wait=True)  # grows the pool: above the 32 MiB reservation
        assert ck.save(2, large).result().ok
        second = zpool.current().arena
        assert second is not first and first.closed, "the pool did not swap to a larger reservation"
        assert second.cuda_registered and second.cuda_pinned_bytes >= 56 * MiB and second.cuda_error is None
        assert ck.save(3, large).result().ok
    for step, w in ((1, want[0]), (2, want[1]), (3, want[1])):
        got = zerostall.load(ckdir, step=step)
        assert got.keys() == w.keys() and all(torch.equal(got[k], w[k]) for k in w), step


def test_saves_overlap_in_a_small_ring_and_each_keeps_its_own_bytes(ckdir):
    """Three saves started back to back through a ring smaller than one state (each streams
    behind the previous one's persist): every step holds the values it was saved with."""
    _fresh_pool()
    x = torch.randn(6 * MiB, device="cuda")  # 24 MiB, ring 16 MiB
    extra = {"scalar": torch.tensor(3.5, device="cuda"), "empty": torch.empty(0, 3, device="cuda"),
             "slice": torch.arange(40, device="cuda", dtype=torch.int64).view(8, 5)[:, 1:4]}
    wants, handles = [], []
    with zerostall.Checkpointer(ckdir, _cfg(16 * MiB, 2 * MiB)) as ck:
        for step in range(3):
            wants.append(x.cpu().clone())
            h = ck.save(step, {"x": x, **extra})
            h.wait_staged()  # the snapshot holds every byte: mutating now is allowed
            x.add_(1)
            handles.append(h)
        assert all(h.result().ok for h in handles)
    for step, w in enumerate(wants):
        got = zerostall.load(ckdir, step=step)
        assert torch.equal(got["x"], w), step
        assert got["scalar"].shape == () and got["scalar"].item() == 3.5
        assert got["empty"].shape == (0, 3)
        assert torch.equal(got["slice"], extra["slice"].cpu())


def test_in_place_load_into_a_cuda_model_and_optimizer(ckdir):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.BatchNorm1d(64), torch.nn.Linear(64, 8)).cuda()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)

    def train_step():
        model(torch.randn(16, 64, device="cuda")).square().mean().backward()
        opt.step()
        opt.zero_grad()

    train_step()
    with zerostall.Checkpointer(ckdir) as ck:
        ck.guard(opt)
        assert ck.save(1, {"model": model.state_dict(), "optim": opt.state_dict()}).result().ok
    want_model = {k: v.cpu().clone() for k, v in model.state_dict().items()}
    want_avg = {i: s["exp_avg"].cpu().clone() for i, s in enumerate(opt.state.values())}
    train_step()
    train_step()  # both differ from the checkpoint now
    assert not torch.equal(model[0].weight.cpu(), want_model["0.weight"])
    ptrs = {k: v.data_ptr() for k, v in model.state_dict().items()}
    target = {"model": model.state_dict(), "optim": opt.state_dict()}
    out = zerostall.load(ckdir, target)
    opt.load_state_dict(out["optim"])
    for k, v in model.state_dict().items():
        assert v.is_cuda and v.data_ptr() == ptrs[k], f"{k} was replaced, not loaded in place"
        assert torch.equal(v.cpu(), want_model[k]), k
    for i, s in enumerate(opt.state.values()):
        assert s["exp_avg"].is_cuda and torch.equal(s["exp_avg"].cpu(), want_avg[i])
    train_step()  # the restored optimizer steps on the device


@pytest.mark.parametrize("where", ["cuda", "cuda:0", "device", "dict", "callable"])
def test_map_location_forms_put_every_tensor_on_the_device(ckdir, where):
    state = {"w": torch.randn(1000, 10), "h": torch.randn(7).half(), "n": {"i": torch.arange(5)}}
    zerostall.save(ckdir, state, 1)
    loc = {"cuda": "cuda", "cuda:0": "cuda:0", "device": torch.device("cuda", 0), "dict": {"cpu": "cuda:0"},
           "callable": lambda storage, location: storage.cuda()}[where]
    out = zerostall.load(ckdir, map_location=loc)
    for got, w in ((out["w"], state["w"]), (out["h"], state["h"]), (out["n"]["i"], state["n"]["i"])):
        assert got.is_cuda and got.dtype == w.dtype and torch.equal(got.cpu(), w)


def _long_kernel_then(fn):
    """Queue ~0.25 s of GPU spin, then ``fn()``, on the current stream (the host does not wait)."""
    torch.cuda._sleep(int(5e8))
    fn()


def test_incremental_crc_sees_device_writes_that_bypass_the_version_counter(ckdir):
    """crc mode on CUDA: a write through DLPack (a new tensor, its own version counter), a write
    through ``.data`` still queued behind a long kernel at save() time, a non-contiguous tensor,
    a tensor larger than one 16 MiB crc piece and a bf16 one: unchanged ones are referenced,
    changed ones written, every step loads bit-exact."""
    _fresh_pool()
    g = torch.Generator(device="cuda").manual_seed(0)
    s = {"big": torch.randn(5 * MiB, device="cuda", generator=g),  # 20 MiB: two crc pieces
         "bf": torch.randn(4096, device="cuda", generator=g).bfloat16(),
         "nc": torch.randn(64, 48, device="cuda", generator=g).t(),
         "head": torch.randn(100, device="cuda", generator=g)}
    wants, recs = [], []
    with zerostall.Checkpointer(ckdir, incremental=True) as ck:
        def save(step):
            wants.append({k: v.cpu().clone() for k, v in s.items()})
            recs.append(ck.save(step, s).result())

        save(0)
        save(1)  # nothing changed
        torch.utils.dlpack.from_dlpack(torch.utils.dlpack.to_dlpack(s["big"]))[5 * MiB - 1] = 42.0
        save(2)
        v_nc = s["nc"]._version
        _long_kernel_then(lambda: s["nc"].data.__setitem__((3, 5), 9.0))
        assert s["nc"]._version == v_nc  # the change is invisible to the version counter
        recs.append(ck.save(3, s).result())  # its crc must run after the queued write
        torch.cuda.synchronize()
        wants.append({k: v.cpu().clone() for k, v in s.items()})
    total = sum(v.numel() * v.element_size() for v in s.values())
    assert recs[1].bytes_referenced == total, "an unchanged CUDA state was rewritten"
    assert recs[2].bytes_referenced == total - s["big"].numel() * 4, "the DLPack write was missed or over-written"
    assert recs[3].bytes_referenced == total - s["nc"].numel() * 4, "the queued .data write was missed"
    for step, w in enumerate(wants):
        got = zerostall.load(ckdir, step=step)
        for k in w:
            assert torch.equal(got[k], w[k]), (step, k)


def test_incremental_version_mode_references_unchanged_cuda_tensors(ckdir):
    s = {"frozen": torch.randn(MiB, device="cuda"), "w": torch.randn(1000, device="cuda")}
    with zerostall.Checkpointer(ckdir, incremental="version") as ck:
        ck.save(0, s).result()
        s["w"].add_(1)
        r = ck.save(1, s).result()
    assert r.bytes_referenced == MiB * 4
    got = zerostall.load(ckdir)
    assert torch.equal(got["frozen"], s["frozen"].cpu()) and torch.equal(got["w"], s["w"].cpu())


def test_dcp_async_save_through_the_zerostall_writer(tmp_path):
    """``dcp.async_save`` (no process group) with CUDA state through zerostall.dcp.Writer, then
    ``dcp.load`` through zerostall.dcp.Reader into CUDA tensors."""
    import torch.distributed.checkpoint as dcp

    import zerostall.dcp

    model = torch.nn.Linear(256, 64).cuda()
    want = {k: v.cpu().clone() for k, v in model.state_dict().items()}
    resp = dcp.async_save({"model": model.state_dict()}, storage_writer=zerostall.dcp.Writer(str(tmp_path / "d")),
                          no_dist=True)
    getattr(resp, "upload_completion", resp).result(timeout=60)
    fresh = torch.nn.Linear(256, 64).cuda()
    dcp.load({"model": fresh.state_dict()}, storage_reader=zerostall.dcp.Reader(str(tmp_path / "d")), no_dist=True)
    for k, v in fresh.state_dict().items():
        assert v.is_cuda and torch.equal(v.cpu(), want[k]), k


def test_lightning_checkpoint_io_with_cuda_state(tmp_path):
    pytest.importorskip("lightning")
    from zerostall.integrations.lightning import ZerostallCheckpointIO

    model = torch.nn.Linear(32, 4).cuda()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    model(torch.randn(2, 32, device="cuda")).sum().backward()
    opt.step()
    ckpt = {"state_dict": model.state_dict(), "optimizer_states": [opt.state_dict()], "epoch": 1,
            "global_step": 3}
    want = {k: v.cpu().clone() for k, v in model.state_dict().items()}
    io = ZerostallCheckpointIO()
    path = tmp_path / "epoch=1.ckpt"
    io.save_checkpoint(ckpt, path)
    opt.step()  # the guard makes it wait for the snapshot
    out = io.load_checkpoint(path, map_location="cuda")
    io.teardown()
    assert out["epoch"] == 1 and out["global_step"] == 3
    for k, v in out["state_dict"].items():
        assert v.is_cuda and torch.equal(v.cpu(), want[k]), k


def test_a_fork_after_a_cuda_save_leaves_the_registered_pool_working(ckdir):
    """A DataLoader-style fork (the child touches no CUDA) between two CUDA saves: the pool's
    arena is MADV_DONTFORK (not copied into the child), and the parent's next save and the
    load of both steps are unaffected."""
    import os

    x = torch.randn(MiB, device="cuda")
    wants = []
    with zerostall.Checkpointer(ckdir) as ck:
        wants.append(x.cpu().clone())
        assert ck.save(1, {"x": x}).result().ok
        assert zpool.current().arena.cuda_pinned_bytes > 0
        pid = os.fork()
        if pid == 0:
            os._exit(0)
        _, status = os.waitpid(pid, 0)
        assert os.WIFEXITED(status) and os.WEXITSTATUS(status) == 0
        x.mul_(3)
        wants.append(x.cpu().clone())
        assert ck.save(2, {"x": x}).result().ok
    for step, w in ((1, wants[0]), (2, wants[1])):
        assert torch.equal(zerostall.load(ckdir, step=step)["x"], w), step
