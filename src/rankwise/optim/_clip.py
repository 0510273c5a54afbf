r"""Gradient clipping that sees what the integrator reads, with ``torch.nn.utils``' signature.

In factor mode (while DLRT/SDLRT trains it) a low-rank layer's ``U.grad``, ``V.grad`` and
``S.grad`` hold G_K = ∇W V (out, r), G_L = ∇Wᵀ U (in, r) and G_S = Uᵀ ∇W V (r, r), the
integrator's gradients. ``torch.nn.utils.clip_grad_norm_`` scales them all by one factor (so
it does clip the step) but measures √(‖G_K‖² + ‖G_L‖² + ‖G_S‖²). :func:`clip_grad_norm_`
measures such a layer by the norm of the weight gradient the step sees, the tangent-space
projection ``P_T ∇W = UUᵀ∇W + ∇W VVᵀ − UUᵀ∇W VVᵀ``, whose squared norm is
``‖G_K‖² + ‖G_L‖² − ‖G_S‖²`` (U, V orthonormal), so that a dense model and a low-rank one are
clipped at the same threshold by comparable norms (the projection's norm is at most the full
gradient's). Every other gradient counts as in torch. No host read unless
``error_if_nonfinite``: the scale is a device tensor, as in torch.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import Tensor, nn

from ..nn._base import layer_of

Parameters = nn.Module | Tensor | Iterable[Tensor]


def _params(parameters: Parameters, what: str) -> list[Tensor]:
    """The tensors of a module, one tensor or an iterable of tensors (each once)."""
    if isinstance(parameters, nn.Module):
        ps: list = list(parameters.parameters())
    elif isinstance(parameters, Tensor):
        ps = [parameters]
    elif isinstance(parameters, Iterable) and not isinstance(parameters, str | bytes):
        ps = list(parameters)
    else:
        raise TypeError(f"{what} takes a model, a tensor or an iterable of tensors (as torch's); "
                        f"got {type(parameters).__name__}")
    bad = next((p for p in ps if not isinstance(p, Tensor)), None)
    if bad is not None:
        raise TypeError(f"{what} takes tensors (parameters); the iterable holds a {type(bad).__name__}")
    seen: dict[int, Tensor] = {}
    for p in ps:
        seen.setdefault(id(p), p)
    return list(seen.values())


def _parts(params: list[Tensor]) -> tuple[list[Tensor], list[Tensor], list[Tensor]]:
    """(gradients counted as they are, factor-mode G_K and G_L, factor-mode G_S): a layer is
    measured by its projection when its U, S and V are all among `params`."""
    given = {id(p) for p in params}
    projected: set[int] = set()
    factors, minus = [], []
    for p in params:
        m = layer_of(p)
        if m is None or m.grad_mode != "factors" or id(m.S) in projected:
            continue
        trio = (m.U, m.S, m.V)
        if all(id(t) in given and t.grad is not None for t in trio):
            projected.add(id(m.S))
            projected.update((id(m.U), id(m.V)))
            factors += [m.U.grad, m.V.grad]
            minus.append(m.S.grad)
    plus = [p.grad for p in params if p.grad is not None and id(p) not in projected]
    return plus, factors, minus


def _sq(tensors: list[Tensor], device: torch.device, foreach: bool | None) -> Tensor:
    """Σ ‖t‖² in float64 on `device`."""
    if not tensors:
        return torch.zeros((), dtype=torch.float64, device=device)
    norms = torch._foreach_norm(tensors, 2.0) if foreach is not False else [t.norm(2.0) for t in tensors]
    return torch.stack([n.to(device, torch.float64) for n in norms]).square().sum()


def _norm(plus: list[Tensor], factors: list[Tensor], minus: list[Tensor], norm_type: float,
          foreach: bool | None) -> Tensor:
    grads = plus + factors + minus
    device = grads[0].device if grads else torch.device("cpu")
    if norm_type == 2.0:
        return (_sq(plus + factors, device, foreach) - _sq(minus, device, foreach)).clamp_min(0).sqrt()
    if not grads:
        return torch.zeros((), dtype=torch.float64, device=device)
    # another p-norm: the projection has no closed form; every gradient as torch counts it
    norms = [torch.linalg.vector_norm(g, norm_type).to(device, torch.float64) for g in grads]
    return torch.linalg.vector_norm(torch.stack(norms), norm_type)


def _norm_type(norm_type: float | str) -> float:
    try:
        value = float(norm_type)
    except (TypeError, ValueError):
        value = float("nan")
    if not value > 0:
        raise ValueError(f"`norm_type` must be > 0 or 'inf'; got {norm_type!r}")
    return value


def grad_norm(parameters: Parameters, norm_type: float | str = 2.0, *, foreach: bool | None = None) -> Tensor:
    """The total gradient norm :func:`clip_grad_norm_` clips by (a float64 device scalar):
    ordinary ``.grad`` s as in torch and, for the 2-norm, each low-rank layer in factor mode by
    √(‖G_K‖² + ‖G_L‖² − ‖G_S‖²), the norm of its projected weight gradient. `parameters`: a
    model, a tensor or an iterable of tensors, as torch's ``clip_grad_norm_`` takes."""
    params = _params(parameters, "grad_norm")
    return _norm(*_parts(params), _norm_type(norm_type), foreach)


def clip_grad_norm_(parameters: Parameters, max_norm: float, norm_type: float | str = 2.0,
                    error_if_nonfinite: bool = False, foreach: bool | None = None) -> Tensor:
    """As ``torch.nn.utils.clip_grad_norm_`` (same arguments: a model, a tensor or an iterable
    of parameters; `norm_type`, `error_if_nonfinite`, `foreach`), measuring a factor-mode
    low-rank layer by its projected weight gradient (module docstring; the 2-norm): every
    gradient the step reads (``.grad`` s, G_K, G_L and G_S among them) is scaled by
    ``min(1, max_norm / (norm + 1e-6))``. Returns the norm before clipping (a float64 device
    tensor: nothing is read back unless `error_if_nonfinite`)."""
    if not max_norm > 0:
        raise ValueError(f"`max_norm` must be > 0; got {max_norm}")
    params = _params(parameters, "clip_grad_norm_")
    plus, factors, minus = _parts(params)
    norm = _norm(plus, factors, minus, _norm_type(norm_type), foreach)
    if error_if_nonfinite and not bool(torch.isfinite(norm)):
        raise RuntimeError(f"the total norm of order {float(norm_type)} of the gradients is non-finite, so "
                           "it cannot be clipped; to clip anyway, pass error_if_nonfinite=False")
    coef = (max_norm / (norm + 1e-6)).clamp(max=1.0)
    by_key: dict[tuple, list[Tensor]] = {}
    for g in plus + factors + minus:
        by_key.setdefault((g.device, g.dtype), []).append(g)
    for (dev, dt), gs in by_key.items():
        if foreach is False:
            for g in gs:
                g.mul_(coef.to(dev, dt))
        else:
            torch._foreach_mul_(gs, coef.to(dev, dt))
    return norm
