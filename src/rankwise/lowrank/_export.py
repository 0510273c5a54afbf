"""export: a plain-PyTorch copy of a low-rank model, for deployment without rankwise.

Each low-rank layer becomes two ordinary torch layers holding its factors (or one dense layer
when factorising would not save anything), so the result can be pickled, loaded, traced or
``torch.export``-ed by code that has never heard of rankwise.
"""

from __future__ import annotations

import copy
from typing import Literal

import torch
from torch import Tensor, nn

from ..linalg import work_dtype
from ._base import AbstractLowRankLayer
from ._conv import LowRankConv2d
from ._linear import LowRankLinear

Merge = Literal["auto", "never", "always"]
MERGE_MODES: tuple[str, ...] = ("auto", "never", "always")


def export(model: nn.Module, *, merge: Merge = "auto") -> nn.Module:
    """A new plain-PyTorch module computing what `model` computes; `model` is not modified.

    Every :class:`LowRankLinear` (weight ``U S Vᵀ``: U (out, r), S (r, r), V (in, r)) becomes

        ``nn.Sequential(nn.Linear(in, r, bias=False), nn.Linear(r, out, bias=<as the layer>))``

    with weights ``Vᵀ`` (r, in) and ``U S`` (out, r), and every :class:`LowRankConv2d`
    (C_in → C_out, kernel kh×kw, weight matrix (C_out, C_in·kh·kw)) becomes

        ``nn.Sequential(nn.Conv2d(C_in, r, (kh, kw), stride, padding, dilation, bias=False),
        nn.Conv2d(r, C_out, 1, bias=<as the layer>))``

    with weights ``Vᵀ`` reshaped to (r, C_in, kh, kw) and ``U S`` as (C_out, r, 1, 1) -- the
    same two convolutions the low-rank forward runs. Everything else is deep-copied as is.

    **Arguments:**
    - `model`: any module; may itself be a low-rank layer.
    - `merge`: when to store a layer as one dense ``nn.Linear`` / ``nn.Conv2d`` with weight
      ``U S Vᵀ`` instead:

      - ``"auto"`` (default): when the factorisation would store at least as many weight
        entries as the dense layer, r·(in + out) ≥ in·out (in = C_in·kh·kw for a conv); then
        the dense layer is no larger and no slower (one product instead of two);
      - ``"never"``: always the two-layer factorisation;
      - ``"always"``: always dense (the exact merged weight, computed in float32/float64).

    **Returns:** the copy, a fresh module tree whose classes all come from ``torch`` (apart from
    your own container classes, which are deep-copied). If `model` itself is a low-rank layer,
    the replacement (an ``nn.Sequential``, or the dense layer) is returned. Each replacement has
    the source layer's dtype, device and train/eval mode; its parameters have
    ``requires_grad=True`` (those of the rest keep theirs) and no ``.grad`` is carried over.
    SDLRT's ``U_buf`` / ``V_buf`` buffers and the gradient ``sink`` are dropped (training
    only), as are hooks registered on the low-rank layers themselves. A layer shared by several
    parents is replaced by one shared replacement. Subclasses of the two low-rank layers are
    exported from their factors alone (an overridden ``forward`` is not consulted).

    **Raises:** ``ValueError`` for an unknown `merge`; ``TypeError`` when `model` holds another
    rankwise module (e.g. a ``LowRankODEBlock``) that has no plain-PyTorch equivalent here.
    """
    if not isinstance(merge, str) or merge not in MERGE_MODES:
        raise ValueError(f"`merge` must be one of {MERGE_MODES}; got {merge!r}")
    _check_exportable(model)
    # Pre-seeding deepcopy's memo makes every reference to a low-rank layer resolve to its
    # replacement (so shared layers stay shared, the root case falls out, and the factors,
    # buffers and sink of the source are never copied).
    memo: dict[int, object] = {
        id(m): plain_layer(m, merge=merge) for m in model.modules() if isinstance(m, AbstractLowRankLayer)
    }
    out = copy.deepcopy(model, memo)
    for p in out.parameters():
        p.grad = None
    return out


def plain_layer(layer: AbstractLowRankLayer, *, merge: Merge = "auto") -> nn.Module:
    """The plain-PyTorch replacement of one low-rank layer (see :func:`export`)."""
    if not isinstance(layer, (LowRankLinear, LowRankConv2d)):
        raise TypeError(f"export supports LowRankLinear and LowRankConv2d; got {type(layer).__name__}")
    dense = merge == "always" or (merge == "auto" and not saves_params(layer))
    with torch.no_grad():
        if isinstance(layer, LowRankLinear):
            new = _dense_linear(layer) if dense else _factored_linear(layer)
        else:
            new = _dense_conv(layer) if dense else _factored_conv(layer)
    return new.train(layer.training)


def saves_params(layer: AbstractLowRankLayer) -> bool:
    """Whether the factorised export, r·(in + out) weight entries, is smaller than in·out."""
    return layer.rank * (layer.in_features + layer.out_features) < layer.in_features * layer.out_features


# ----------------------------------------------------------------------------- pieces
def _check_exportable(model: nn.Module) -> None:
    """Refuse rankwise modules other than the two low-rank layers: their forward is rankwise code."""
    bad = [
        f"{name or '<root>'} ({type(m).__name__})"
        for name, m in model.named_modules()
        if type(m).__module__.split(".")[0] == "rankwise"
        and not isinstance(m, (LowRankLinear, LowRankConv2d))
    ]
    if bad:
        raise TypeError("export cannot turn these rankwise modules into plain PyTorch: " + ", ".join(bad))


def _factors(layer: AbstractLowRankLayer) -> tuple[Tensor, Tensor]:
    """(Vᵀ (r, in), U S (out, r)) in the layer's dtype; U S is formed in float32/float64."""
    U, S, V = layer.U.detach(), layer.S.detach(), layer.V.detach()
    wd = work_dtype(U.dtype)
    return V.mT.contiguous(), (U.to(wd) @ S.to(wd)).to(U.dtype)


def _merged(layer: AbstractLowRankLayer) -> Tensor:
    """U S Vᵀ (out, in), formed in float32/float64, in the layer's dtype."""
    U, S, V = layer.U.detach(), layer.S.detach(), layer.V.detach()
    wd = work_dtype(U.dtype)
    return (U.to(wd) @ S.to(wd) @ V.to(wd).mT).to(U.dtype)


def _kw(layer: AbstractLowRankLayer) -> dict:
    return {"device": layer.U.device, "dtype": layer.U.dtype}


def _copy_bias(dst: nn.Module, layer: AbstractLowRankLayer) -> None:
    if layer.bias is not None:
        dst.bias.copy_(layer.bias.detach())


def _factored_linear(layer: LowRankLinear) -> nn.Sequential:
    """Linear(in → r, no bias) with weight Vᵀ, then Linear(r → out) with weight U S."""
    vt, us = _factors(layer)
    first = nn.Linear(layer.in_features, layer.rank, bias=False, **_kw(layer))
    second = nn.Linear(layer.rank, layer.out_features, bias=layer.bias is not None, **_kw(layer))
    first.weight.copy_(vt)
    second.weight.copy_(us)
    _copy_bias(second, layer)
    return nn.Sequential(first, second)


def _dense_linear(layer: LowRankLinear) -> nn.Linear:
    """Linear(in → out) with weight U S Vᵀ."""
    new = nn.Linear(layer.in_features, layer.out_features, bias=layer.bias is not None, **_kw(layer))
    new.weight.copy_(_merged(layer))
    _copy_bias(new, layer)
    return new


def _factored_conv(layer: LowRankConv2d) -> nn.Sequential:
    """Conv2d(C_in → r, kh×kw, no bias) with filters Vᵀ, then a 1×1 Conv2d(r → C_out) with U S."""
    vt, us = _factors(layer)
    r = layer.rank
    first = nn.Conv2d(layer.in_channels, r, layer.kernel_size, layer.stride, layer.padding,
                      layer.dilation, bias=False, **_kw(layer))
    second = nn.Conv2d(r, layer.out_channels, 1, bias=layer.bias is not None, **_kw(layer))
    first.weight.copy_(vt.reshape(r, layer.in_channels, *layer.kernel_size))
    second.weight.copy_(us[:, :, None, None])
    _copy_bias(second, layer)
    return nn.Sequential(first, second)


def _dense_conv(layer: LowRankConv2d) -> nn.Conv2d:
    """Conv2d(C_in → C_out, kh×kw) with weight U S Vᵀ reshaped to (C_out, C_in, kh, kw)."""
    new = nn.Conv2d(layer.in_channels, layer.out_channels, layer.kernel_size, layer.stride,
                    layer.padding, layer.dilation, bias=layer.bias is not None, **_kw(layer))
    new.weight.copy_(_merged(layer).reshape(new.weight.shape))
    _copy_bias(new, layer)
    return new
