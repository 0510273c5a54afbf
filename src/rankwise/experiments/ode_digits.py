"""A low-rank matrix-memory neural ODE classifier on permuted sequential digits.

The state F (m×m, rank r) is a matrix memory written by the pixels: pixel i (centred to
[−1, 1]) enters as the rank-1, position-specific term u_i·p_i q_iᵀ, and the memory evolves as
dF/dt = 0.5·tanh(A F Bᵀ) − 0.2 F + u_i p_i q_iᵀ for one step of size h per pixel; a linear layer
reads the class from F. One :class:`LowRankODEBlock` integrates the 64 pixels (a fixed random
permutation of the 8×8 digits). Design found by trying variants (docs/ode.md): the input term
must depend on the pixel's position, otherwise F is an unordered bag of pixel values.
"""

from __future__ import annotations

import itertools
import time
from dataclasses import dataclass

import torch
from torch import nn

from ..data import load_digits
from ..ode import AbstractController, DefectController, FixedController, LowRankODEBlock, audit_gradients


class PixelField(nn.Module):
    """dF/dt for (B, m, m) states; ``x`` (B, T) holds the current batch's pixel sequence."""

    def __init__(self, m: int, T: int, h: float) -> None:
        super().__init__()
        self.m, self.T, self.h = m, T, h
        self.A = nn.Parameter(0.3 * torch.randn(m, m) / m**0.5)
        self.B = nn.Parameter(0.3 * torch.randn(m, m) / m**0.5)
        self.P = nn.Parameter(torch.randn(T, m))
        self.Q = nn.Parameter(torch.randn(T, m))
        self.x: torch.Tensor | None = None

    def forward(self, t: float, F: torch.Tensor) -> torch.Tensor:
        i = min(int(t / self.h + 1e-6), self.T - 1)
        u = (2 * self.x[:, i] - 1)[:, None, None].to(F.dtype)
        inp = u * (self.P[i][:, None] * self.Q[i][None, :]).to(F.dtype)
        return 0.5 * torch.tanh(self.A @ F @ self.B.T) - 0.2 * F + inp


class MatrixMemoryClassifier(nn.Module):
    def __init__(self, controller: AbstractController, *, m: int = 16, rank: int = 8, T: int = 64,
                 h: float = 0.125, seed: int = 0) -> None:
        super().__init__()
        self.field = PixelField(m, T, h)
        self.block = LowRankODEBlock(self.field, rank=rank, steps=T, h=h, controller=controller, seed=seed)
        self.out = nn.Linear(m * m, 10)
        self.m = m

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.field.x = x
        g = torch.Generator().manual_seed(1)
        F0 = 0.01 * torch.randn(x.shape[0], self.m, self.m, generator=g)
        return self.out(self.block(F0).dense().flatten(1))


@dataclass(frozen=True)
class OdeRunConfig:
    controller: str = "fixed"  # "fixed" or "adaptive"
    c: int = 8
    rank: int = 8
    max_rank: int = 16
    epochs: int = 1
    lr: float = 1e-2
    batch_size: int = 64
    seed: int = 0


def _tape_bytes(block: LowRankODEBlock) -> int:
    """Bytes the reversal backward keeps: checkpoints and per-step rotations (measured from the
    tape's tensors)."""
    t = block.last_tape
    if t is None:
        return 0
    cps = sum(x.nbytes for cp in t.checkpoints for x in (cp.X, cp.S, cp.V))
    return cps + sum(q.nbytes for pair in t.rotations for q in pair)


def run(cfg: OdeRunConfig, callback=None) -> dict:
    """Train on the first 1400 permuted digits, test on the rest; returns the metrics."""
    torch.manual_seed(cfg.seed)
    train, test = load_digits(seed=cfg.seed)
    perm = torch.randperm(64, generator=torch.Generator().manual_seed(123))
    xtr, ytr = train.tensors[0].flatten(1)[:, perm], train.tensors[1]
    xte, yte = test.tensors[0].flatten(1)[:, perm], test.tensors[1]
    ctl = (FixedController(cfg.c, cfg.rank) if cfg.controller == "fixed" else
           DefectController.for_dtype(torch.float32, c_init=cfg.c, max_rank=cfg.max_rank))
    model = MatrixMemoryClassifier(ctl, rank=cfg.rank, seed=cfg.seed)
    opt = torch.optim.Adam(model.parameters(), cfg.lr)
    losses, ranks, cps, deltas, mem, reloads = [], [], [], [], [], []
    t0 = time.perf_counter()
    for epoch in range(cfg.epochs):
        order = torch.randperm(len(xtr))
        for k in range(0, len(xtr), cfg.batch_size):
            b = order[k:k + cfg.batch_size]
            loss = nn.functional.cross_entropy(model(xtr[b]), ytr[b])
            opt.zero_grad()
            loss.backward()
            nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            st = model.block.last_stats
            losses.append(loss.item())
            ranks.append(st["rank"])
            cps.append(st["checkpoints"])
            deltas.append(st["max_delta"])
            mem.append(_tape_bytes(model.block))
            reloads.append(st.get("reloads", 0))
            if callback:
                callback(epoch, k, float(loss))
    with torch.no_grad():
        model.block.reversible = False
        acc = float((model(xte).argmax(1) == yte).float().mean())
        model.block.reversible = True
    model.field.x = xte[:16]  # gradient audit on a small test batch
    cos = audit_gradients(model.block, 0.01 * torch.randn(16, model.m, model.m),
                          lambda s: nn.functional.cross_entropy(model.out(s.dense().flatten(1)), yte[:16]))
    tail = losses[len(losses) // 2:]
    mean = sum(tail) / len(tail)
    return dict(config=cfg.__dict__, test_acc=acc, mean_rank=sum(ranks) / len(ranks),
                mean_checkpoints=sum(cps) / len(cps), max_delta=max(deltas),
                peak_tape_mib=max(mem) / 2**20, grad_cosine=cos,
                mean_reloads=sum(reloads) / len(reloads),
                loss_var_2nd_half=sum((x - mean) ** 2 for x in tail) / len(tail),
                loss_spikes=sum(1 for a, b in itertools.pairwise(losses) if b > 2 * a),
                seconds=time.perf_counter() - t0)
