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
