"""Measurement helpers: parameter counts and SDLRT's stability distance d_t."""

from __future__ import annotations

import torch
from torch import nn

from ..linalg import work_dtype
from ._attention import PROJECTIONS, dense_projections
from ._base import AbstractLowRankLayer, check_model
from ._hf import is_hf_conv1d


def _low_rank_layers(model: nn.Module) -> dict[str, AbstractLowRankLayer]:
    """Each low-rank layer once (under its first name), however many names it is registered under."""
    return {n: m for n, m in model.named_modules() if isinstance(m, AbstractLowRankLayer)}


def compression(model: nn.Module) -> dict[str, float]:
    """Parameter counts of a (partly) low-rank model.

    **Returns** a dict with
    - `dense_params`: parameters of the dense equivalent (each low-rank layer counted as its
      out×in weight + bias, everything else as is),
    - `stored_params`: what inference needs: U, S, V (r·(out+in) + r²) + bias + every
      parameter that is not low-rank,
    - `buffer_params`: SDLRT compensation buffers (b·(out+in)), training only,
    - `ratio` = 1 − stored/dense and `training_ratio` = 1 − (stored + buffer)/dense.

    Only parameters are counted (not buffers such as BatchNorm statistics), in both totals, and
    each once by identity: a tied weight (an ``lm_head`` sharing the embedding's Parameter) or a
    layer registered under several names counts once, as ``model.parameters()`` lists it.
    ``TypeError`` if `model` is not an ``nn.Module`` (e.g. ``model.parameters()``).
    """
    check_model(model, "compression")
    lr = _low_rank_layers(model)
    factor_ids = {id(p) for m in lr.values() for p in (m.U, m.S, m.V)}
    unique = {id(p): p for _, p in model.named_parameters(remove_duplicate=False)}
    other = sum(p.numel() for i, p in unique.items() if i not in factor_ids)
    dense = other + sum(m.out_features * m.in_features for m in lr.values())
    stored = other + sum(m.live_params() for m in lr.values())  # (at a fixed capacity: the live rank's)
    buf = sum(sum(t.numel() for t in m.live_buffer()) for m in lr.values())
    return {
        "dense_params": dense,
        "stored_params": stored,
        "buffer_params": buf,
        "ratio": 1.0 - stored / dense if dense else 0.0,
        "training_ratio": 1.0 - (stored + buf) / dense if dense else 0.0,
    }


@torch.no_grad()
def stability_distance(low_rank_model: nn.Module, dense_model: nn.Module) -> float:
    """SDLRT's d_t = Σ_layers ‖SVD_r(W_dense) − U S Vᵀ‖_F, r = each layer's current rank.

    `dense_model` is a dense shadow with the same architecture (same module names) trained on
    the same batches from the same initialisation. Each low-rank layer is paired with the
    module of the same name in the shadow, whose ``weight`` is viewed as (out, in·kh·kw) (a
    Hugging Face ``Conv1D``'s (in, out) weight transposed); the projections of a
    :class:`LowRankMultiheadAttention` with the shadow ``nn.MultiheadAttention``'s q, k, v and
    output weights.
    """
    check_model(low_rank_model, "stability_distance")
    check_model(dense_model, "stability_distance")
    dense_mods = dict(dense_model.named_modules())
    total = 0.0
    for name, layer in _low_rank_layers(low_rank_model).items():
        W = _shadow_matrix(dense_mods, name)
        if W.shape != (layer.out_features, layer.in_features):
            raise ValueError(f"layer {name!r}: dense weight {tuple(W.shape)} does not match "
                             f"low-rank ({layer.out_features}, {layer.in_features})")
        dt = torch.promote_types(work_dtype(W.dtype), work_dtype(layer.U.dtype))
        U, s, Vh = torch.linalg.svd(W.to(dt), full_matrices=False)
        r = layer.rank
        best = (U[:, :r] * s[:r]) @ Vh[:r]
        total += float(torch.linalg.matrix_norm(best - layer.weight_matrix().to(dt)))
    return total


def _shadow_matrix(dense_mods: dict[str, nn.Module], name: str) -> torch.Tensor:
    """The dense shadow's weight matrix (out, in) for the low-rank layer called `name`."""
    parent, _, child = name.rpartition(".")
    if isinstance(dense_mods.get(parent), nn.MultiheadAttention) and child in PROJECTIONS:
        return dense_projections(dense_mods[parent])[child][0]
    shadow = dense_mods.get(name)
    if shadow is None or not hasattr(shadow, "weight"):
        raise ValueError(f"dense_model has no layer {name!r} with a weight to compare against")
    if is_hf_conv1d(shadow):
        return shadow.weight.mT
    return shadow.weight.reshape(shadow.weight.shape[0], -1)
