"""CUDA paths (skipped without a GPU): registered arena, side-stream copies, restore to cuda."""

import pytest
import torch

import zerostall

pytestmark = pytest.mark.gpu


def test_cuda_state_roundtrip_and_guard(ckdir):
    model = torch.nn.Linear(1024, 1024).cuda()
    opt = torch.optim.AdamW(model.parameters())
    model(torch.randn(8, 1024, device="cuda")).sum().backward()
    opt.step()
    with zerostall.Checkpointer(ckdir) as ck:
        ck.guard(opt)
        state = {"model": model.state_dict(), "optim": opt.state_dict(),
                 "nc": torch.randn(64, 32, device="cuda").t()}
        expected = {"w": model.weight.detach().cpu().clone(), "nc": state["nc"].cpu().clone()}
        h = ck.save(1, state)
        model(torch.randn(8, 1024, device="cuda")).sum().backward()
        opt.step()  # waits for the device-to-host snapshot
        assert h.result().ok
        assert ck.arena.cuda_registered
    out = zerostall.load(ckdir, map_location="cuda")
    assert out["model"]["weight"].is_cuda
    assert torch.equal(out["model"]["weight"].cpu(), expected["w"])
    assert torch.equal(out["nc"].cpu(), expected["nc"])
    fresh = torch.nn.Linear(1024, 1024).cuda()
    target = {"model": fresh.state_dict()}
    zerostall.load(ckdir, target)
    assert torch.equal(fresh.weight.cpu(), expected["w"])


def _wait_behind_a_long_kernel(device, t):
    """Queue a long spin and then ``t.fill_(1)`` on ``device``'s current stream: a copy that
    does not wait for that stream reads zeros."""
    with torch.cuda.device(device):
        torch.cuda._sleep(int(2e9))  # ~1 s of GPU cycles on the current stream
        t.fill_(1.0)


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA devices")
def test_two_devices_each_copy_waits_for_its_own_device(ckdir):
    """A rank whose state lives on cuda:1 (LOCAL_RANK 1 of a node) and on cuda:0: every byte
    of each device's tensor is the value queued on that device's stream before save()."""
    a = torch.zeros(8 << 20, device="cuda:0")
    b = torch.zeros(8 << 20, device="cuda:1")
    _wait_behind_a_long_kernel(1, b)
    _wait_behind_a_long_kernel(0, a)
    with zerostall.Checkpointer(ckdir) as ck:
        h = ck.save(1, {"a": a, "b": b})
        h.wait_staged()
        for t in (a, b):  # mutate right after staging: the snapshot must already hold the ones
            with torch.cuda.device(t.device):
                t.zero_()
        assert h.result().ok
    out = zerostall.load(ckdir)
    assert torch.equal(out["a"], torch.ones(8 << 20)) and torch.equal(out["b"], torch.ones(8 << 20))


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA devices")
def test_two_devices_guard_waits_for_its_optimizer_only(ckdir):
    m1 = torch.nn.Linear(1024, 1024).to("cuda:1")
    opt = torch.optim.SGD(m1.parameters(), lr=0.1)
    m1(torch.randn(8, 1024, device="cuda:1")).sum().backward()
    expected = m1.weight.detach().cpu().clone()
    with zerostall.Checkpointer(ckdir) as ck:
        ck.guard(opt)
        h = ck.save(1, {"m1": m1.state_dict()})
        opt.step()  # waits until cuda:1's weights are in the arena
        assert h.result().ok
    assert torch.equal(zerostall.load(ckdir)["m1"]["weight"], expected)


def test_copy_waits_for_the_callers_stream(ckdir):
    """One device: the snapshot holds the value queued on the current stream before save()
    (a copy on a side stream that did not wait for it would read zeros), and the caller may
    overwrite the tensor as soon as the save is staged."""
    a = torch.zeros(8 << 20, device="cuda")
    _wait_behind_a_long_kernel(0, a)
    with zerostall.Checkpointer(ckdir) as ck:
        h = ck.save(1, {"a": a})
        h.wait_staged()
        a.zero_()
        assert h.result().ok
    assert torch.equal(zerostall.load(ckdir)["a"], torch.ones(8 << 20))


def test_dtypes_layouts_and_streaming_through_a_small_ring(ckdir):
    """bf16/fp16/int8/bool, a transposed view and a tensor larger than the staging budget
    (streamed through the ring) come back bit-exact, on the device they are loaded to."""
    g = torch.Generator(device="cuda").manual_seed(0)
    big = torch.randn(48 << 20, device="cuda", generator=g)  # 192 MiB > 64 MiB budget
    state = {
        "bf16": torch.randn(1000, 33, device="cuda", generator=g).to(torch.bfloat16),
        "fp16": torch.randn(77, device="cuda", generator=g).half(),
        "i8": torch.randint(-128, 127, (4096,), device="cuda", dtype=torch.int8, generator=g),
        "mask": torch.rand(513, device="cuda", generator=g) > 0.5,
        "t": torch.randn(300, 200, device="cuda", generator=g).t(),
        "big": big,
    }
    want = {k: v.cpu().clone() for k, v in state.items()}
    from zerostall.saving import pool as zpool
    zpool.release_now()  # a larger pool left by an earlier test would not stream
    cfg = zerostall.CheckpointConfig(staging=zerostall.StagingConfig(budget_bytes=64 << 20, block_bytes=8 << 20))
    with zerostall.Checkpointer(ckdir, cfg) as ck:
        assert ck.save(1, state).result().ok
    out = zerostall.load(ckdir, map_location="cuda:0")
    for k, v in want.items():
        assert out[k].device.type == "cuda", k
        assert out[k].dtype == v.dtype and out[k].shape == v.shape, k
        assert torch.equal(out[k].cpu(), v), k


def test_one_shot_save_and_new_checkpointers_share_a_pinned_pool(tmp_path):
    """Several Checkpointers and the one-shot save in one process: every save of CUDA state
    round-trips, and the pool they share is registered with CUDA (page-locked)."""
    from zerostall.saving import pool as zpool

    x = torch.randn(4 << 20, device="cuda")
    saved = []
    for i in range(3):
        with zerostall.Checkpointer(tmp_path / f"ck{i}") as ck:
            assert ck.save(i, {"x": x}).result().ok
            p = zpool.current()
            assert p is not None and p.arena.cuda_registered
        saved.append(x.cpu())
        x.add_(1)
    rec = zerostall.save(tmp_path / "one", {"x": x}, 7)
    assert rec.ok
    assert torch.equal(zerostall.load(tmp_path / "one")["x"], x.cpu())
    for i, want in enumerate(saved):
        assert torch.equal(zerostall.load(tmp_path / f"ck{i}")["x"], want), i


def test_dcp_writer_and_reader_with_cuda_tensors(tmp_path):
    """``dcp.save``/``dcp.load`` (no process group) through zerostall.dcp with CUDA tensors."""
    import torch.distributed.checkpoint as dcp

    import zerostall.dcp

    model = torch.nn.Linear(256, 128).cuda()
    sd = {"model": model.state_dict()}
    want = {k: v.cpu().clone() for k, v in model.state_dict().items()}
    dcp.save(sd, storage_writer=zerostall.dcp.Writer(str(tmp_path / "d")))
    fresh = torch.nn.Linear(256, 128).cuda()
    target = {"model": fresh.state_dict()}
    dcp.load(target, storage_reader=zerostall.dcp.Reader(str(tmp_path / "d")))
    for k, v in want.items():
        assert torch.equal(fresh.state_dict()[k].cpu(), v), k
