"""compression() and stability_distance() against hand counts and dense SVDs."""

import copy

import numpy as np
import pytest
import torch
from torch import nn

import rankwise
from helpers import F64, mse_closure
from rankwise import SDLRT, LowRankLinear


def _model():
    return nn.Sequential(nn.Conv2d(2, 6, 3), nn.ReLU(), nn.Flatten(), nn.Linear(6 * 4, 10),
                         nn.LayerNorm(10), nn.Linear(10, 3)).double()


def test_compression_counts():
    model = rankwise.to_low_rank(_model(), rank=2, exclude=["5"])
    c = rankwise.compression(model)
    other = 6 + 10 + 20 + 10 * 3 + 3  # conv bias, linear bias, layernorm, dense last layer
    assert c["dense_params"] == other + 6 * 18 + 10 * 24
    assert c["stored_params"] == other + 2 * (6 + 18) + 4 + 2 * (10 + 24) + 4
    assert c["buffer_params"] == 0
    assert c["ratio"] == pytest.approx(1 - c["stored_params"] / c["dense_params"])
    layer = model[3]
    layer.set_factors(layer.U, layer.S, layer.V, torch.zeros(10, 2, dtype=F64), torch.zeros(24, 2, dtype=F64))
    c2 = rankwise.compression(model)
    assert c2["buffer_params"] == 2 * (10 + 24)
    assert c2["training_ratio"] == pytest.approx(1 - (c2["stored_params"] + 68) / c2["dense_params"])


def test_stability_distance_zero_for_truncated_svd_of_shadow():
    shadow = _model()
    low = rankwise.to_low_rank(copy.deepcopy(shadow), rank=3)
    assert rankwise.stability_distance(low, shadow) == pytest.approx(0.0, abs=1e-12)


def test_stability_distance_matches_numpy_reference():
    torch.manual_seed(1)
    shadow = _model()
    low = rankwise.to_low_rank(copy.deepcopy(shadow), rank=3)
    x, y = torch.randn(8, 2, 4, 4, dtype=F64), torch.randn(8, 3, dtype=F64)
    opt = SDLRT(low, 0.1, tau=0.3)
    for _ in range(3):
        opt.step(mse_closure(opt, low, x, y))
    ref = 0.0
    for name in ("0", "3", "5"):
        lr_layer = low.get_submodule(name)
        W = shadow.get_submodule(name).weight.detach().reshape(lr_layer.out_features, -1)
        u, s, vt = np.linalg.svd(W.numpy(), full_matrices=False)
        r = lr_layer.rank
        ref += np.linalg.norm(u[:, :r] * s[:r] @ vt[:r] - lr_layer.weight_matrix().detach().numpy())
    assert rankwise.stability_distance(low, shadow) == pytest.approx(ref, rel=1e-10)
    with pytest.raises(ValueError, match="no layer"):
        rankwise.stability_distance(low, nn.Sequential())


def test_training_survives_a_kept_graph_across_rank_changes():
    """A user holding a non-detached output while ranks change must not break the next step."""
    layer = LowRankLinear(12, 10, 6, dtype=F64)
    x, y = torch.randn(16, 12, dtype=F64), torch.randn(16, 10, dtype=F64)
    opt = SDLRT(layer, 0.2, tau=0.5, single_pass=False)
    kept = []
    for _ in range(4):
        kept.append(layer(x).sum())  # keeps autograd graphs (and gradient accumulators) alive
        opt.step(mse_closure(opt, layer, x, y))
    assert layer.rank != 6  # ranks did change while the graphs were alive
