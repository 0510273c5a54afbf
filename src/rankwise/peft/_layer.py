"""AdapterLinear: a frozen ``nn.Linear`` W0 plus a trainable low-rank adapter U S Vᵀ."""

from __future__ import annotations

import torch
from torch import Tensor, nn

from ..linalg import work_dtype
from ..nn._autograd import LowRankLinearFn
from ..nn._base import AbstractLowRankLayer, orthonormal


class AdapterLinear(AbstractLowRankLayer):
    """``y = base(x) + alpha · (U S Vᵀ) dropout(x)``, with ``base`` a frozen ``nn.Linear``.

    A low-rank layer of the core (U (out, r), S (r, r), V (in, r), buffers for SDLRT), so
    :class:`rankwise.DLRT` / :class:`rankwise.SDLRT` integrate it unchanged; the base weight and
    bias never require grad.

    **Initialisation.** U and V are random orthonormal bases (QR of a Gaussian matrix, from
    torch's global generator) and S = 0: the adapter's product is zero, so the wrapped model
    computes exactly what it did, while the integrator's first augmentation still has a proper
    orthonormal pair to project the gradient on (G_K = ∇W·V, G_L = ∇Wᵀ·U are non-zero, unlike
    LoRA's zero-initialised B, whose gradient is what moves it first).
    """

    def __init__(self, base: nn.Linear, rank: int, *, max_rank: int | None = None, alpha: float = 1.0,
                 dropout: float = 0.0) -> None:
        if type(base) is not nn.Linear:
            raise TypeError(f"AdapterLinear wraps an nn.Linear; got {type(base).__name__}")
        full = min(base.in_features, base.out_features)
        super().__init__(base.out_features, base.in_features, min(rank, full),
                         max_rank=None if max_rank is None else max(min(max_rank, full), min(rank, full)),
                         bias=False, device=base.weight.device, dtype=base.weight.dtype)
        self.base = base
        for p in base.parameters():
            p.requires_grad_(False)
        self.alpha = float(alpha)
        self.dropout = nn.Dropout(dropout) if dropout else nn.Identity()

    @torch.no_grad()
    def reset_parameters(self) -> None:
        """Random orthonormal U, V; S = 0 (see the class docstring)."""
        dt = work_dtype(self.U.dtype)
        r = self.rank
        self.set_factors(orthonormal(self.out_features, r, dtype=dt), torch.zeros(r, r, dtype=dt),
                         orthonormal(self.in_features, r, dtype=dt))

    def forward(self, x: Tensor) -> Tensor:
        delta = LowRankLinearFn.apply(self.dropout(x), *self.factors(), None,
                                       self.grad_mode == "factors")
        return self.base(x) + self.alpha * delta

    _weight_is = "W0 + alpha · U S Vᵀ: the frozen base weight with the adapter merged"
    _edit_instead = "edit the base layer's weight (`base.weight`) or the adapter's factors (`set_factors`)"

    def dense_weight(self) -> Tensor:
        """W0 + alpha · U S Vᵀ (out_features, in_features): the merged weight."""
        return self.base.weight + self.alpha * self.weight_matrix().to(self.base.weight)

    def extra_repr(self) -> str:
        return super().extra_repr() + f", alpha={self.alpha:g}"
