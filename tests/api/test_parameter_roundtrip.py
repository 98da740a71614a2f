"""``torch.nn.Parameter`` leaves: accepted by ``save()`` and loaded back by docs/usage.md's listed
conversion (a plain tensor, ``requires_grad`` False), while an in-place load fills the caller's
Parameter and leaves it a Parameter.

Found by adv2: the conversion was not listed in "What a state dict may hold" in docs/usage.md.
``model.state_dict(keep_vars=True)`` and ``dict(model.named_parameters())`` hold Parameters."""

import torch

import zerostall


def test_parameter_loads_back_as_a_plain_tensor_by_the_listed_conversion(tmp_path):
    d = str(tmp_path / "ck")
    p = torch.nn.Parameter(torch.arange(4.0))
    zerostall.save(d, {"p": p}, step=0)
    out = zerostall.load(d)["p"]
    assert torch.equal(out, p.detach())
    assert type(out) is torch.Tensor and not out.requires_grad


def test_in_place_load_fills_the_callers_parameter(tmp_path):
    d = str(tmp_path / "ck")
    zerostall.save(d, {"p": torch.nn.Parameter(torch.arange(4.0))}, step=0)
    mine = torch.nn.Parameter(torch.zeros(4))
    zerostall.load(d, {"p": mine})
    assert type(mine) is torch.nn.Parameter and mine.requires_grad
    assert torch.equal(mine.detach(), torch.arange(4.0))
