"""export: a plain-PyTorch copy of a low-rank model, for deployment without rankwise.

Each low-rank layer becomes two ordinary torch layers holding its factors (or one dense layer
when factorising would not save anything), so the result can be pickled, loaded, traced or
``torch.export``-ed by code that has never heard of rankwise.
"""

from __future__ import annotations

import copy
import warnings
from typing import Literal

import torch
from torch import Tensor, nn

from ..linalg import work_dtype
from ._attention import LowRankMultiheadAttention
from ._base import AbstractLowRankLayer, check_model
from ._conv import LowRankConv2d
from ._convert import own_rng
from ._hf import LowRankConv1D, hf_conv1d
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
    same two convolutions the low-rank forward runs. A :class:`LowRankConv1D` (Hugging Face's
    GPT-2 projections) becomes the same pair of ``nn.Linear``, or merged a real
    ``transformers.pytorch_utils.Conv1D`` (weight (in, out) = (U S Vᵀ)ᵀ), so that
    ``export(model, merge="always").save_pretrained(dir)`` reloads with HF's ``from_pretrained``.
    A :class:`LowRankMultiheadAttention` becomes an ``nn.MultiheadAttention`` with the merged
    weights (``in_proj_weight`` = the q, k, v weights stacked, or the three separate weights
    when kdim / vdim differ; ``out_proj``), whatever `merge` says: torch's attention has no
    factorised form. So does a low-rank layer whose torch parent reads its ``weight``
    (``linear1`` / ``linear2`` of an ``nn.TransformerEncoderLayer``, whose eval fast path passes
    the weights to a fused kernel; the ``out_proj`` of an ``nn.MultiheadAttention``), with a
    warning when `merge` is ``"never"``. Everything else is deep-copied as is.

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
    your own container classes, which are deep-copied, and HF ``Conv1D``). If `model` itself is
    a low-rank layer, the replacement (an ``nn.Sequential``, or the dense layer) is returned.
    Each replacement has the source layer's dtype, device and train/eval mode; its parameters
    have ``requires_grad=True`` (those of the rest keep theirs) and no ``.grad`` is carried over.
    SDLRT's ``U_buf`` / ``V_buf`` buffers and the gradient ``sink`` are dropped (training
    only), as are hooks registered on the low-rank layers themselves. A layer shared by several
    parents is replaced by one shared replacement. Subclasses of the two low-rank layers are
    exported from their factors alone (an overridden ``forward`` is not consulted).

    **Raises:** ``ValueError`` for an unknown `merge`; ``TypeError`` when `model` holds another
    rankwise module (e.g. a ``LowRankODEBlock``) that has no plain-PyTorch equivalent here, or
    is not an ``nn.Module`` (e.g. ``model.parameters()``).
    """
    check_model(model, "export")
    if not isinstance(merge, str) or merge not in MERGE_MODES:
        raise ValueError(f"`merge` must be one of {MERGE_MODES}; got {merge!r}")
    _check_exportable(model)
    dense = _read_by_parent(model)
    if merge == "never" and dense:
        warnings.warn("export(merge='never'): storing these layers dense, as their torch parent reads "
                      f"their weight: {', '.join(map(repr, dense.values()))}", stacklevel=2)
    # Pre-seeding deepcopy's memo makes every reference to a low-rank layer resolve to its
    # replacement (so shared layers stay shared, the root case falls out, and the factors,
    # buffers and sink of the source are never copied).
    with own_rng(model):  # (the new layers draw an initialisation, overwritten at once)
        memo: dict[int, object] = {
            id(m): plain_layer(m, merge="always" if id(m) in dense else merge) for m in _outermost(model)
        }
    out = copy.deepcopy(model, memo)
    for p in out.parameters():
        p.grad = None
    return out


def plain_layer(layer: nn.Module, *, merge: Merge = "auto") -> nn.Module:
    """The plain-PyTorch replacement of one low-rank layer or attention (see :func:`export`)."""
    if not isinstance(layer, _EXPORTABLE):
        raise TypeError("export supports LowRankLinear, LowRankConv2d, LowRankConv1D and "
                        f"LowRankMultiheadAttention; got {type(layer).__name__}")
    with torch.no_grad():
        if isinstance(layer, LowRankMultiheadAttention):
            return _attention(layer).train(layer.training)
        dense = merge == "always" or (merge == "auto" and not saves_params(layer))
        if isinstance(layer, LowRankConv1D) and dense:
            new = _dense_conv1d(layer)
        elif isinstance(layer, LowRankLinear):
            new = _dense_linear(layer) if dense else _factored_linear(layer)
        else:
            new = _dense_conv(layer) if dense else _factored_conv(layer)
    return new.train(layer.training)


def saves_params(layer: AbstractLowRankLayer) -> bool:
    """Whether the factorised export, r·(in + out) weight entries, is smaller than in·out."""
    return layer.rank * (layer.in_features + layer.out_features) < layer.in_features * layer.out_features


# ----------------------------------------------------------------------------- pieces
_EXPORTABLE = (LowRankLinear, LowRankConv2d, LowRankMultiheadAttention)
# torch modules whose forward reads these children's ``weight`` (a fused eval fast path, or
# F.multi_head_attention_forward): a factorised nn.Sequential there would fail
_WEIGHT_READERS: tuple[tuple[type[nn.Module], tuple[str, ...]], ...] = (
    (nn.TransformerEncoderLayer, ("linear1", "linear2")),
    (nn.MultiheadAttention, ("out_proj",)),
)


def _check_exportable(model: nn.Module) -> None:
    """Refuse rankwise modules other than the low-rank layers and attention: their forward is
    rankwise code."""
    bad = [
        f"{name or '<root>'} ({type(m).__name__})"
        for name, m in model.named_modules()
        if type(m).__module__.split(".")[0] == "rankwise"
        and not isinstance(m, _EXPORTABLE)
    ]
    if bad:
        raise TypeError("export cannot turn these rankwise modules into plain PyTorch: " + ", ".join(bad))


def _outermost(model: nn.Module) -> list[nn.Module]:
    """The low-rank layers and attention modules to replace: not the projections inside an attention."""
    inner = {id(p) for m in model.modules() if isinstance(m, LowRankMultiheadAttention)
             for p in m.projections().values()}
    return [m for m in model.modules()
            if isinstance(m, AbstractLowRankLayer | LowRankMultiheadAttention) and id(m) not in inner]


def _read_by_parent(model: nn.Module) -> dict[int, str]:
    """``{id(layer): name}`` of the low-rank layers whose torch parent reads their ``weight``."""
    out = {}
    for name, parent in model.named_modules():
        for cls, children in _WEIGHT_READERS:
            if not isinstance(parent, cls) or isinstance(parent, LowRankMultiheadAttention):
                continue
            for child in children:
                layer = getattr(parent, child, None)
                if isinstance(layer, AbstractLowRankLayer):
                    out.setdefault(id(layer), f"{name}.{child}" if name else child)
    return out


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


def _dense_conv1d(layer: LowRankConv1D) -> nn.Module:
    """HF ``Conv1D(nf=out, nx=in)`` with weight (U S Vᵀ)ᵀ (in, out)."""
    new = hf_conv1d(layer.out_features, layer.in_features, **_kw(layer))
    new.weight.copy_(_merged(layer).mT)
    if layer.bias is None:  # (Conv1D always has one; a LowRankConv1D built without adds zero)
        new.bias.zero_()
    else:
        new.bias.copy_(layer.bias.detach())
    return new


def _attention(layer: LowRankMultiheadAttention) -> nn.MultiheadAttention:
    """``nn.MultiheadAttention`` with the merged projections (packed or separate as kdim / vdim say)."""
    proj = layer.projections()
    bias = proj["q_proj"].bias is not None
    with_bias = [p for p, m in proj.items() if m.bias is not None]
    if with_bias and len(with_bias) < len(proj):
        raise TypeError("export: nn.MultiheadAttention has biases on all four projections or on none; "
                        f"this LowRankMultiheadAttention has them on {with_bias}")
    new = nn.MultiheadAttention(layer.embed_dim, layer.num_heads, dropout=layer.dropout, bias=bias,
                                kdim=layer.kdim, vdim=layer.vdim, batch_first=layer.batch_first,
                                **_kw(proj["q_proj"]))
    qkv = [_merged(proj[p]) for p in ("q_proj", "k_proj", "v_proj")]
    if new._qkv_same_embed_dim:
        new.in_proj_weight.copy_(torch.cat(qkv))
    else:
        for w, target in zip(qkv, (new.q_proj_weight, new.k_proj_weight, new.v_proj_weight), strict=True):
            target.copy_(w)
    new.out_proj.weight.copy_(_merged(proj["out_proj"]))
    if bias:
        new.in_proj_bias.copy_(torch.cat([proj[p].bias.detach() for p in ("q_proj", "k_proj", "v_proj")]))
        new.out_proj.bias.copy_(proj["out_proj"].bias.detach())
    return new
