"""The bench's states: a GPT-shaped state of a given size, bit-exact comparison, a settled GC.

The model the demo trains (and the bench's frozen-base scenario fine-tunes) is the library's
:mod:`zerostall.demo.model`.
"""

from __future__ import annotations

import math

import torch


def settle_gc() -> None:
    """Collect once and move every live object out of the cyclic GC's reach (``gc.freeze()``),
    as a tuned trainer does after building its model (torchtitan disables automatic GC and
    collects every N steps). Without it a full collection, ~145 ms in a process that has
    imported torch on this 2-vCPU machine (168k tracked objects), lands in whatever call
    allocates next, a save() of any method included. Called by the bench for every method."""
    import gc
    gc.collect()
    gc.freeze()


def gpt_state_for_size(size_bytes: int, seed: int = 0) -> dict[str, dict[str, torch.Tensor]]:
    """fp32 parameters of a GPT-style model plus AdamW ``exp_avg``/``exp_avg_sq``, about
    ``size_bytes`` in total (3 x 4 bytes per parameter), shaped like a real transformer's."""
    n_params = max(1, size_bytes // 12)
    d = 256
    while 12 * (2 * d) ** 2 * 4 <= n_params:  # aim for >= 4 layers
        d *= 2
    n_layer = max(1, round(n_params / (12 * d * d)))
    vocab = 32000
    shapes: dict[str, tuple[int, ...]] = {}
    budget = n_params
    emb = min(vocab * d, budget // 10)
    shapes["tok_emb.weight"] = (max(1, emb // d), d)
    budget -= shapes["tok_emb.weight"][0] * d
    for i in range(n_layer):
        for name, shp in ((f"h.{i}.attn.qkv.weight", (3 * d, d)), (f"h.{i}.attn.proj.weight", (d, d)),
                          (f"h.{i}.mlp.fc.weight", (4 * d, d)), (f"h.{i}.mlp.proj.weight", (d, 4 * d)),
                          (f"h.{i}.ln1.weight", (d,)), (f"h.{i}.ln2.weight", (d,))):
            n = math.prod(shp)
            if n > budget:
                break
            shapes[name] = shp
            budget -= n
    g = torch.Generator().manual_seed(seed)
    params = {k: torch.empty(s).uniform_(-0.02, 0.02, generator=g) for k, s in shapes.items()}
    exp_avg = {k: torch.empty(s).uniform_(-1e-3, 1e-3, generator=g) for k, s in shapes.items()}
    exp_avg_sq = {k: torch.empty(s).uniform_(0, 1e-6, generator=g) for k, s in shapes.items()}
    return {"model": params, "optim_exp_avg": exp_avg, "optim_exp_avg_sq": exp_avg_sq}


def states_equal(a: object, b: object) -> bool:
    """Bit-exact equality of nested state dicts (dicts, lists/tuples, tensors, plain values):
    same keys, lengths, dtypes, shapes and bytes; tensors on different devices are compared
    on the CPU. The bench checks every method's restore with it."""
    if isinstance(a, torch.Tensor):
        if not (isinstance(b, torch.Tensor) and a.dtype == b.dtype and a.shape == b.shape):
            return False
        return torch.equal(a, b) if a.device == b.device else torch.equal(a.cpu(), b.cpu())
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(states_equal(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return isinstance(b, (list, tuple)) and len(a) == len(b) and all(states_equal(x, y) for x, y in zip(a, b))
    return bool(a == b)
