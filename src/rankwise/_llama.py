"""A small LLaMA-style decoder for byte-level language modelling: pre-norm blocks with RMSNorm,
rotary positions on the queries and keys, a SwiGLU MLP and an untied output head.

Every projection is a plain ``nn.Linear`` without bias (attention ``q``, ``k``, ``v``, ``o``;
MLP ``gate``, ``up``, ``down``), so :func:`rankwise.to_low_rank` can factor exactly those; the
output ``head`` is an ``nn.Linear`` too, left dense by the language-model study (as the GPT's
tied head is).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ._gpt import Attention


def rotary(x: Tensor, base: float = 10000.0) -> Tensor:
    """Rotary position embedding of x (B, heads, T, d), d even: each pair of coordinates
    (x_2i, x_2i+1) at position t rotated by the angle t·base^(−2i/d). So the product of a
    query at position m and a key at position n depends on m − n only."""
    T, d = x.shape[-2], x.shape[-1]
    inv = base ** (-torch.arange(0, d, 2, device=x.device, dtype=torch.float32) / d)
    angle = torch.arange(T, device=x.device, dtype=torch.float32)[:, None] * inv[None, :]  # (T, d/2)
    cos, sin = angle.cos().to(x.dtype), angle.sin().to(x.dtype)
    x1, x2 = x[..., 0::2], x[..., 1::2]
    return torch.stack((x1 * cos - x2 * sin, x1 * sin + x2 * cos), dim=-1).flatten(-2)


class _SwiGLU(nn.Module):
    def __init__(self, width: int, hidden: int):
        super().__init__()
        self.gate = nn.Linear(width, hidden, bias=False)
        self.up = nn.Linear(width, hidden, bias=False)
        self.down = nn.Linear(hidden, width, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        return self.down(F.silu(self.gate(x)) * self.up(x))


class _Block(nn.Module):
    def __init__(self, width: int, heads: int, hidden: int):
        super().__init__()
        self.norm1, self.norm2 = nn.RMSNorm(width), nn.RMSNorm(width)
        self.attn = Attention(width, heads, positions=rotary)
        self.mlp = _SwiGLU(width, hidden)

    def forward(self, x: Tensor) -> Tensor:
        x = x + self.attn(self.norm1(x))
        return x + self.mlp(self.norm2(x))


class Llama(nn.Module):
    """Causal decoder: tokens (B, T) int64 -> logits (B, T, vocab). ``T`` ≤ ``context``. The
    MLP's hidden width is ``hidden`` (default: 8/3 of the width rounded up to a multiple of 8,
    LLaMA's choice, so that its three matrices hold as many parameters as GPT's two at 4×)."""

    def __init__(self, vocab: int = 257, context: int = 128, width: int = 256, depth: int = 4,
                 heads: int = 4, hidden: int | None = None):
        super().__init__()
        hidden = 8 * math.ceil(8 * width / 3 / 8) if hidden is None else hidden
        for name, v in (("vocab", vocab), ("context", context), ("width", width), ("depth", depth),
                        ("heads", heads), ("hidden", hidden)):
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"`{name}` must be a positive int; got {v!r}")
        if width % heads or (width // heads) % 2:
            raise ValueError(f"`width` ({width}) must be a multiple of `heads` ({heads}) with an even "
                             f"head size (rotary positions turn pairs of coordinates)")
        self.context = context
        self.tok = nn.Embedding(vocab, width)
        self.blocks = nn.ModuleList(_Block(width, heads, hidden) for _ in range(depth))
        self.norm = nn.RMSNorm(width)
        self.head = nn.Linear(width, vocab, bias=False)
        self.reset_parameters(depth)

    @torch.no_grad()
    def reset_parameters(self, depth: int) -> None:
        """normal(0, 0.02) for every matrix, the projections into the residual stream (``o``,
        ``down``) scaled by 1/√(2·depth), as the GPT's."""
        for name, p in self.named_parameters():
            if p.dim() == 2:
                std = 0.02 / math.sqrt(2 * depth) if name.endswith(("o.weight", "down.weight")) else 0.02
                nn.init.normal_(p, std=std)

    def forward(self, idx: Tensor) -> Tensor:
        T = idx.shape[1]
        if self.context < T:
            raise ValueError(f"sequence of {T} tokens is longer than the context ({self.context})")
        x = self.tok(idx)
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x))


def llama(vocab: int = 257, context: int = 128, width: int = 256, depth: int = 4, heads: int = 4,
          hidden: int | None = None) -> Llama:
    """A :class:`Llama` (defaults: byte vocabulary with a separator, 4 blocks of width 256)."""
    return Llama(vocab, context, width, depth, heads, hidden)
