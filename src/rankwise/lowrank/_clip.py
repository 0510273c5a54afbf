r"""Gradient clipping that sees what the integrator reads.

``torch.nn.utils.clip_grad_norm_(model.parameters(), c)`` misses a low-rank layer in factor
mode: its U and V have no ``.grad``; the integrator reads G_K = ∇W V (out, r), G_L = ∇Wᵀ U
(in, r) and G_S = Uᵀ ∇W V (r, r) instead. :func:`clip_grad_norm_` measures such a layer by the
norm of the weight gradient it sees, the tangent-space projection
``P_T ∇W = UUᵀ∇W + ∇W VVᵀ − UUᵀ∇W VVᵀ``, whose squared norm is
``‖G_K‖² + ‖G_L‖² − ‖G_S‖²`` (U, V orthonormal), and scales G_K, G_L and G_S together. Every
other gradient counts as in torch. A dense model and a low-rank one are thus clipped at the
same threshold by comparable norms (the projection's norm is at most the full gradient's).
No host read: the scale is a device tensor, as in torch.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from ._base import AbstractLowRankLayer


def _sq(tensors: list[Tensor], device: torch.device) -> Tensor:
    """Σ ‖t‖² in float64 on `device`."""
    if not tensors:
        return torch.zeros((), dtype=torch.float64, device=device)
    norms = torch._foreach_norm(tensors, 2.0)
    return torch.stack([n.to(device, torch.float64) for n in norms]).square().sum()


def _parts(model: nn.Module) -> tuple[list[Tensor], list[Tensor], list[Tensor]]:
    """(gradients counted as they are, factor-mode G_K and G_L, factor-mode G_S)."""
    plus, factors, minus = [], [], []
    skip: set[int] = set()
    for m in model.modules():
        if isinstance(m, AbstractLowRankLayer) and m.sink.enabled:
            gk, gl = m.factor_grads()
            if gk is not None and gl is not None and m.S.grad is not None:
                factors += [gk, gl]
                minus.append(m.S.grad)
                skip.add(id(m.S))
    for p in model.parameters():
        if p.grad is not None and id(p) not in skip:
            plus.append(p.grad)
    return plus, factors, minus


def grad_norm(model: nn.Module) -> Tensor:
    """The global gradient norm :func:`clip_grad_norm_` clips by (a float64 device scalar):
    ordinary ``.grad`` s as in torch, and each low-rank layer in factor mode by
    √(‖G_K‖² + ‖G_L‖² − ‖G_S‖²), the norm of its projected weight gradient."""
    plus, factors, minus = _parts(model)
    device = next((t.device for t in plus + factors), torch.device("cpu"))
    return (_sq(plus + factors, device) - _sq(minus, device)).clamp_min(0).sqrt()


def clip_grad_norm_(model: nn.Module, max_norm: float, eps: float = 1e-6) -> Tensor:
    """Scale every gradient of `model` (``.grad`` s, and the factor gradients G_K, G_L of
    low-rank layers in factor mode) by ``min(1, max_norm / (norm + eps))`` with the norm of
    :func:`grad_norm`, as ``torch.nn.utils.clip_grad_norm_`` does for ordinary parameters.
    Returns the norm before clipping (a device tensor: nothing is read back)."""
    if not max_norm > 0:
        raise ValueError(f"`max_norm` must be > 0; got {max_norm}")
    plus, factors, minus = _parts(model)
    device = next((t.device for t in plus + factors), torch.device("cpu"))
    norm = (_sq(plus + factors, device) - _sq(minus, device)).clamp_min(0).sqrt()
    coef = (max_norm / (norm + eps)).clamp(max=1.0)
    grads = plus + factors + minus
    by_key: dict[tuple, list[Tensor]] = {}
    for g in grads:
        by_key.setdefault((g.device, g.dtype), []).append(g)
    for (dev, dt), gs in by_key.items():
        torch._foreach_mul_(gs, coef.to(dev, dt))
    return norm
