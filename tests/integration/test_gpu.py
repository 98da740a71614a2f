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
