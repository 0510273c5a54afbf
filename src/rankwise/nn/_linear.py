"""LowRankLinear: ``y = x (U S Vᵀ)ᵀ + b``."""

from __future__ import annotations

import torch
import torch.fx
from torch import Tensor, nn

from ._autograd import LowRankLinearFn
from ._base import AbstractLowRankLayer, from_dense_weight, layer_of


def low_rank_linear(x: Tensor, U: Tensor, S: Tensor, V: Tensor, bias: Tensor | None) -> Tensor:
    """A low-rank layer's forward as one call, with its layer's gradient mode read when it runs:
    what ``torch.fx.symbolic_trace`` records for :class:`LowRankLinear` (a leaf node, so that a
    traced graph trained by DLRT gets the factor gradients as the layer would)."""
    layer = layer_of(U)
    return LowRankLinearFn.apply(x, U, S, V, bias, layer is not None and layer.grad_mode == "factors")


torch.fx.wrap("low_rank_linear")


class LowRankLinear(AbstractLowRankLayer):
    """Drop-in replacement for ``nn.Linear`` with weight ``U S Vᵀ`` of rank ``rank``.

    **Arguments:**
    - `in_features`, `out_features`: as ``nn.Linear``.
    - `rank`: initial rank r, 1 <= r <= min(in, out).
    - `max_rank`: the most an integrator may grow it to (default min(in, out)).
    - `bias`: learn an additive bias (out,).

    Input (..., in_features) → output (..., out_features). Factors: ``U`` (out, r),
    ``S`` (r, r), ``V`` (in, r).
    """

    def __init__(self, in_features: int, out_features: int, rank: int, *,
                 max_rank: int | None = None, bias: bool = True, device=None, dtype=None) -> None:
        super().__init__(out_features, in_features, rank, max_rank=max_rank, bias=bias,
                         device=device, dtype=dtype)

    def forward(self, x: Tensor) -> Tensor:
        if torch.fx._symbolic_trace.is_fx_symbolic_tracing():
            self._check_traceable()
            return low_rank_linear(x, self.U, self.S, self.V, self.bias)
        if x.shape[-1] != self.in_features:
            raise ValueError(f"expected input (..., {self.in_features}); got {tuple(x.shape)}")
        return LowRankLinearFn.apply(x, *self.factors(), self.bias, self._factor_mode())

    def dense_weight(self) -> Tensor:
        """(out_features, in_features), as ``nn.Linear.weight``."""
        return self.weight_matrix()

    @classmethod
    @torch.no_grad()
    def from_dense(cls, linear: nn.Linear, *, rank: int | None = None, tau: float | None = None,
                   max_rank: int | None = None) -> LowRankLinear:
        """Truncated SVD of ``linear.weight``: a fixed ``rank``, or the smallest rank whose
        discarded tail is ≤ ``tau``·‖W‖_F (both: the smaller). The bias is copied."""
        W = linear.weight
        return from_dense_weight(
            lambda r, hi: cls(linear.in_features, linear.out_features, r, bias=linear.bias is not None,
                              max_rank=hi, device=W.device, dtype=W.dtype),
            W, linear.bias, rank=rank, tau=tau, max_rank=max_rank)
