"""A small GPT-style decoder for byte-level language modelling (pre-norm blocks, learned
positions, tied input and output embeddings).

Every projection is a plain ``nn.Linear`` (attention ``q``, ``k``, ``v``, ``o``; MLP ``fc``,
``proj``), so :func:`rankwise.to_low_rank` can factor exactly those; the output head reuses
the token embedding's weight through ``F.linear`` and is never factored.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor, nn


class Attention(nn.Module):
    """Causal multi-head attention with separate ``q``, ``k``, ``v``, ``o`` projections (no bias);
    `positions` (queries and keys (B, heads, T, d) -> the same) adds positions inside it (the
    LLaMA-style model's rotary embedding; the GPT adds learned ones to the input instead)."""

    def __init__(self, width: int, heads: int, positions=None):
        super().__init__()
        self.heads = heads
        self.positions = positions
        self.q, self.k, self.v, self.o = (nn.Linear(width, width, bias=False) for _ in range(4))

    def forward(self, x: Tensor) -> Tensor:  # (B, T, width) -> (B, T, width)
        B, T, C = x.shape
        h = self.heads
        q, k, v = (p(x).view(B, T, h, C // h).transpose(1, 2) for p in (self.q, self.k, self.v))
        if self.positions is not None:
            q, k = self.positions(q), self.positions(k)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.o(y.transpose(1, 2).reshape(B, T, C))


class _Block(nn.Module):
    def __init__(self, width: int, heads: int, mlp_ratio: int):
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(width), nn.LayerNorm(width)
        self.attn = Attention(width, heads)
        self.fc = nn.Linear(width, mlp_ratio * width)
        self.proj = nn.Linear(mlp_ratio * width, width)

    def forward(self, x: Tensor) -> Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.proj(F.gelu(self.fc(self.ln2(x))))


class GPT(nn.Module):
    """Causal decoder: tokens (B, T) int64 -> logits (B, T, vocab). ``T`` ≤ ``context``."""

    def __init__(self, vocab: int = 257, context: int = 128, width: int = 256, depth: int = 4,
                 heads: int = 4, mlp_ratio: int = 4):
        super().__init__()
        for name, v in (("vocab", vocab), ("context", context), ("width", width), ("depth", depth),
                        ("heads", heads), ("mlp_ratio", mlp_ratio)):
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"`{name}` must be a positive int; got {v!r}")
        if width % heads:
            raise ValueError(f"`width` ({width}) must be a multiple of `heads` ({heads})")
        self.context = context
        self.tok = nn.Embedding(vocab, width)
        self.pos = nn.Embedding(context, width)
        self.blocks = nn.ModuleList(_Block(width, heads, mlp_ratio) for _ in range(depth))
        self.ln = nn.LayerNorm(width)
        self.reset_parameters(depth)

    @torch.no_grad()
    def reset_parameters(self, depth: int) -> None:
        """GPT-2's initialisation: normal(0, 0.02), the projections into the residual stream
        (``o``, ``proj``) scaled by 1/√(2·depth), zero biases."""
        for name, p in self.named_parameters():
            if p.dim() == 2:
                std = 0.02 / math.sqrt(2 * depth) if name.endswith(("o.weight", "proj.weight")) else 0.02
                nn.init.normal_(p, std=std)
            elif name.endswith("bias") and "ln" not in name:
                nn.init.zeros_(p)

    def forward(self, idx: Tensor) -> Tensor:
        T = idx.shape[1]
        if self.context < T:
            raise ValueError(f"sequence of {T} tokens is longer than the context ({self.context})")
        x = self.tok(idx) + self.pos(torch.arange(T, device=idx.device))
        for block in self.blocks:
            x = block(x)
        return F.linear(self.ln(x), self.tok.weight)


def gpt(vocab: int = 257, context: int = 128, width: int = 256, depth: int = 4, heads: int = 4,
        mlp_ratio: int = 4) -> GPT:
    """A :class:`GPT` (defaults: byte vocabulary with a separator, 4 blocks of width 256, 3.2M
    parameters)."""
    return GPT(vocab, context, width, depth, heads, mlp_ratio)
