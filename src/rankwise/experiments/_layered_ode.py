"""The first study's model: a layered low-rank matrix-memory ODE classifier (``model="layered"``
in :mod:`rankwise.experiments.ode_seq`). The state of every layer is an m×m matrix memory F,
kept as X S Vᵀ.

- Layer 1 reads the sequence: step i (one KSL step of size h) writes the input value u_i as the
  rank-1, position-specific term u_i·p_i q_iᵀ, and the memory evolves as
  dF/dt = 0.5·tanh(A F Bᵀ) − 0.2 F + u_i p_i q_iᵀ. The write must depend on the position, or F is
  an unordered bag of input values (tried first: 10–20 % on digits).
- Layers 2…L are autonomous depth blocks, dF/dt = 0.5·tanh(A_ℓ F B_ℓᵀ) − 0.2 F + a_ℓ b_ℓᵀ, each for
  ``depth_steps`` steps, taking the previous layer's factors (and rank) as their initial state.
- A linear layer reads the class from the last F.

Every layer is a :class:`LowRankODEBlock` with its own checkpoints and the shared controller
rules.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from ..ode import AbstractController, LowRankODEBlock


class SequenceField(nn.Module):
    """dF/dt for (B, m, m) states driven by ``self.u`` (B, T), the current batch's sequence."""

    def __init__(self, m: int, T: int, h: float) -> None:
        super().__init__()
        self.m, self.T, self.h = m, T, h
        self.A = nn.Parameter(0.3 * torch.randn(m, m) / m**0.5)
        self.B = nn.Parameter(0.3 * torch.randn(m, m) / m**0.5)
        self.P = nn.Parameter(torch.randn(T, m))
        self.Q = nn.Parameter(torch.randn(T, m))
        self.u: Tensor | None = None

    def forward(self, t: float, F: Tensor) -> Tensor:
        if self.u is None:
            raise RuntimeError("SequenceField.u is not set; call the model, not the block")
        i = min(int(t / self.h + 1e-6), self.T - 1)
        u = self.u[:, i][:, None, None].to(F.dtype)
        inp = u * (self.P[i][:, None] * self.Q[i][None, :]).to(F.dtype)
        return 0.5 * torch.tanh(self.A @ F @ self.B.T) - 0.2 * F + inp


class DepthField(nn.Module):
    """Autonomous dF/dt = 0.5·tanh(A F Bᵀ) − 0.2 F + a bᵀ for (B, m, m) states."""

    def __init__(self, m: int) -> None:
        super().__init__()
        self.A = nn.Parameter(torch.eye(m) + 0.3 * torch.randn(m, m) / m**0.5)
        self.B = nn.Parameter(torch.eye(m) + 0.3 * torch.randn(m, m) / m**0.5)
        self.a = nn.Parameter(0.1 * torch.randn(m))
        self.b = nn.Parameter(0.1 * torch.randn(m))

    def forward(self, t: float, F: Tensor) -> Tensor:
        del t
        bias = (self.a[:, None] * self.b[None, :]).to(F.dtype)
        return 0.5 * torch.tanh(self.A @ F @ self.B.T) - 0.2 * F + bias


class LayeredMemoryODE(nn.Module):
    """``layers`` stacked :class:`LowRankODEBlock` s; ``forward(u)``: u (B, T) -> logits (B, classes)."""

    def __init__(self, controller: AbstractController, *, T: int, classes: int = 10, m: int = 32,
                 rank: int = 8, layers: int = 6, depth_steps: int = 8, h: float = 0.125,
                 seed: int = 0) -> None:
        super().__init__()
        if layers < 1:
            raise ValueError(f"need layers >= 1; got {layers}")
        self.m = m
        self.seq = SequenceField(m, T, h)
        fields = [self.seq] + [DepthField(m) for _ in range(layers - 1)]
        self.blocks = nn.ModuleList(
            LowRankODEBlock(f, rank=rank, steps=T if k == 0 else depth_steps, h=h, controller=controller,
                            seed=seed * 1000 + k)
            for k, f in enumerate(fields))
        self.out = nn.Linear(m * m, classes)

    def initial_state(self, batch: int) -> Tensor:
        """The fixed small initial memory F0 (batch, m, m) every sequence starts from."""
        g = torch.Generator().manual_seed(1)
        return 0.01 * torch.randn(batch, self.m, self.m, generator=g)

    def integrate(self, F0: Tensor) -> Tensor:
        """Logits from an initial memory F0 (B, m, m), for the sequence already set in ``seq.u``."""
        state = F0
        for b in self.blocks:
            state = b(state)
        return self.out(state.dense().flatten(1))

    def set_input(self, u: Tensor) -> None:
        """The sequences u (B, T) the next integration reads."""
        self.seq.u = u.detach()

    def forward(self, u: Tensor) -> Tensor:
        self.set_input(u)
        return self.integrate(self.initial_state(u.shape[0]))
