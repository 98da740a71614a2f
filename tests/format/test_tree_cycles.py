"""Encoding and decoding a state tree leave no reference cycle: the tensors they were given
are freed by reference counting alone (a restore's scratch, the whole state, used to stay
mapped until the next cyclic GC, whose munmap then landed inside a later save())."""

import gc
import weakref

import torch

from zerostall.format.tree import decode_tree, encode_tree


def test_tensors_passed_through_encode_and_decode_are_freed_without_the_gc():
    gc.collect()
    gc.disable()
    try:
        src = torch.arange(16.0)
        tree, leaves = encode_tree({"m": {"w": src, "n": [1, 2.5, "x"]}, "step": 3})
        scratch = torch.zeros(16)  # what a restore reads into
        out = decode_tree(tree, [scratch])
        assert out["m"]["w"] is scratch and out["step"] == 3 and out["m"]["n"] == [1, 2.5, "x"]
        refs = [weakref.ref(src), weakref.ref(scratch)]
        del src, scratch, leaves, out, tree
        assert [r() is None for r in refs] == [True, True]
    finally:
        gc.enable()
