"""The demo's (and the bench's) small GPT-style model and a corpus generated from a fixed seed;
every batch is a pure function of (seed, step), so a resumed run sees exactly the data an
uninterrupted run would.
"""

from __future__ import annotations

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


class Block(nn.TransformerEncoderLayer):
    """A pre-norm causal transformer block: attention, then a GELU MLP of 4 x d_model; no dropout."""

    def __init__(self, cfg: GPTConfig):
        super().__init__(cfg.d_model, cfg.n_head, 4 * cfg.d_model, dropout=0.0, activation="gelu",
                         batch_first=True, norm_first=True)
        self.register_buffer("mask", torch.triu(torch.full((cfg.ctx, cfg.ctx), float("-inf")), 1), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        t = x.shape[1]
        return super().forward(x, src_mask=self.mask[:t, :t], is_causal=True)


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
