"""A small GPT-style language model and a deterministic corpus, for the demo and the bench.

Nothing is downloaded: the corpus is generated from a fixed seed, and every training batch
is a pure function of (seed, step), so a resumed run sees exactly the data an uninterrupted
run would.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import nn

_WORDS = ("the model writes a checkpoint while training continues and the disk drains "
          "pages slowly so every rank waits on the slowest host unless the data bypasses "
          "the page cache with direct io from a pinned staging arena then commits it "
          "atomically and verifies every byte on restore").split()


def corpus(n_chars: int = 200_000, seed: int = 1234) -> str:
    """A deterministic pseudo-English text (a seeded bigram walk over a small vocabulary)."""
    g = torch.Generator().manual_seed(seed)
    idx = torch.randint(0, len(_WORDS), (n_chars // 4,), generator=g).tolist()
    out, n, prev = [], 0, 0
    for i in idx:
        w = _WORDS[(prev * 7 + i) % len(_WORDS)] if i % 3 else _WORDS[i]
        prev = i
        out.append(w)
        n += len(w) + 1
        if n >= n_chars:
            break
    return " ".join(out)[:n_chars]


@dataclass(frozen=True)
class GPTConfig:
    vocab: int = 96
    ctx: int = 64
    d_model: int = 128
    n_layer: int = 2
    n_head: int = 4

    @property
    def n_params(self) -> int:
        d = self.d_model
        return self.vocab * d + self.ctx * d + self.n_layer * (12 * d * d + 13 * d) + 2 * d + d * self.vocab


class Block(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        d = cfg.d_model
        self.ln1 = nn.LayerNorm(d)
        self.attn = nn.MultiheadAttention(d, cfg.n_head, batch_first=True)
        self.ln2 = nn.LayerNorm(d)
        self.mlp = nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d))
        self.register_buffer("mask", torch.triu(torch.full((cfg.ctx, cfg.ctx), float("-inf")), 1),
                             persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        t = x.shape[1]
        h = self.ln1(x)
        a, _ = self.attn(h, h, h, attn_mask=self.mask[:t, :t], need_weights=False)
        x = x + a
        return x + self.mlp(self.ln2(x))


class TinyGPT(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.cfg = cfg
        self.tok = nn.Embedding(cfg.vocab, cfg.d_model)
        self.pos = nn.Embedding(cfg.ctx, cfg.d_model)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layer))
        self.ln = nn.LayerNorm(cfg.d_model)
        self.head = nn.Linear(cfg.d_model, cfg.vocab, bias=False)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.tok(idx) + self.pos(torch.arange(idx.shape[1]))
        for b in self.blocks:
            x = b(x)
        return self.head(self.ln(x))


def encode(text: str, vocab: int = 96) -> torch.Tensor:
    return torch.tensor([min(max(ord(c) - 32, 0), vocab - 1) for c in text], dtype=torch.long)


def batch(data: torch.Tensor, step: int, seed: int, batch_size: int, ctx: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed * 1_000_003 + step)
    ix = torch.randint(0, data.numel() - ctx - 1, (batch_size,), generator=g)
    x = torch.stack([data[i:i + ctx] for i in ix.tolist()])
    y = torch.stack([data[i + 1:i + 1 + ctx] for i in ix.tolist()])
    return x, y


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
    on the CPU. The one comparison of the bench, the crash soak and the tests."""
    if isinstance(a, torch.Tensor):
        if not (isinstance(b, torch.Tensor) and a.dtype == b.dtype and a.shape == b.shape):
            return False
        return torch.equal(a, b) if a.device == b.device else torch.equal(a.cpu(), b.cpu())
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(states_equal(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return isinstance(b, (list, tuple)) and len(a) == len(b) and all(states_equal(x, y) for x, y in zip(a, b))
    return bool(a == b)
