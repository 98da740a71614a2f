"""Incremental saves at their edges (issue 23): identity comes from the typed tree path, a lost
or damaged base never stops saving, and the content check stays within the staging budget."""

import logging
import os
import shutil

import pytest
import torch

import zerostall
from zerostall.store.local import LocalTier

pytestmark = pytest.mark.timeout(120)


def _distinct(n=1024, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, generator=g), torch.randn(n, generator=g)


@pytest.mark.parametrize("mode", ["version", True])
@pytest.mark.parametrize("layout", ["dotted_vs_nested", "int_vs_str", "tuple_vs_list"])
def test_keys_that_print_alike_are_different_tensors(ckdir, mode, layout):
    """Two tensors whose key paths print the same string never share a record: the unchanged
    second save loads each one's own bytes (version mode referenced one for the other)."""
    t1, t2 = _distinct()
    state = {"dotted_vs_nested": {"a.b": t1, "a": {"b": t2}},
             "int_vs_str": {0: t1, "0": t2},
             "tuple_vs_list": {"x": (t1,), "x.0": t2}}[layout]  # "x.0": a tuple position and a str key
    with zerostall.Checkpointer(ckdir, incremental=mode, full_every=None) as ck:
        ck.save(0, state).result()
        r = ck.save(1, state).result()
        assert r.bytes_referenced == 2 * t1.numel() * 4  # both unchanged: both referenced
    for step in (0, 1):
        got = zerostall.load(ckdir, step=step)
        if layout == "dotted_vs_nested":
            assert torch.equal(got["a.b"], t1) and torch.equal(got["a"]["b"], t2), step
        elif layout == "int_vs_str":
            assert torch.equal(got[0], t1) and torch.equal(got["0"], t2), step
        else:
            assert torch.equal(got["x"][0], t1) and torch.equal(got["x.0"], t2), step


def test_identity_survives_a_restart(ckdir):
    """A base read from disk (a new Checkpointer) is matched by the same typed paths."""
    t1, t2 = _distinct(seed=1)
    state = {"a.b": t1, "a": {"b": t2}, 0: t2.clone(), "0": t1.clone()}
    with zerostall.Checkpointer(ckdir, incremental="version", full_every=None) as ck:
        ck.save(0, state).result()
    with zerostall.Checkpointer(ckdir, incremental="version", full_every=None) as ck:
        ck.save(1, state).result()
        r = ck.save(2, state).result()
        assert r.bytes_referenced == 4 * t1.numel() * 4
    for step in (1, 2):
        got = zerostall.load(ckdir, step=step)
        assert torch.equal(got["a.b"], t1) and torch.equal(got["a"]["b"], t2)
        assert torch.equal(got[0], t2) and torch.equal(got["0"], t1)
