"""rankwise.clip_grad_norm_: torch's clipping for ordinary gradients; for a low-rank layer in
factor mode, the norm of the projected weight gradient P_T ∇W (checked against dense autograd
in float64) and G_K, G_L, G_S scaled together."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import rankwise
from rankwise import DLRT, LowRankLinear

F64 = torch.float64


def _data():
    g = torch.Generator().manual_seed(3)
    return torch.randn(16, 9, generator=g, dtype=F64), torch.randn(16, 5, generator=g, dtype=F64)


def test_a_dense_model_is_clipped_as_torch_clips_it():
    torch.manual_seed(0)
    a = nn.Sequential(nn.Linear(9, 7), nn.Tanh(), nn.Linear(7, 5)).to(F64)
    b = nn.Sequential(nn.Linear(9, 7), nn.Tanh(), nn.Linear(7, 5)).to(F64)
    b.load_state_dict(a.state_dict())
    X, Y = _data()
    for m in (a, b):
        ((m(X) - Y) ** 2).sum().backward()
    want = nn.utils.clip_grad_norm_(a.parameters(), 0.5)
    got = rankwise.clip_grad_norm_(b, 0.5)
    assert want > 0.5
    torch.testing.assert_close(got, want.to(F64), atol=1e-12, rtol=0)
    for p, q in zip(a.parameters(), b.parameters(), strict=True):
        torch.testing.assert_close(q.grad, p.grad, atol=1e-14, rtol=0)


def _lowrank_and_dense():
    torch.manual_seed(1)
    low = nn.Sequential(LowRankLinear(9, 8, rank=3, dtype=F64), nn.Tanh(), nn.Linear(8, 5, dtype=F64))
    layer = low[0]
    W = (layer.U @ layer.S @ layer.V.T).detach().clone().requires_grad_()
    dense_head = nn.Linear(8, 5, dtype=F64)
    dense_head.load_state_dict(low[2].state_dict())

    def dense_forward(X):
        return dense_head(torch.tanh(X @ W.T + layer.bias))

    return low, layer, W, dense_head, dense_forward


def test_a_factor_mode_layer_is_measured_by_its_projected_weight_gradient():
    low, layer, W, head, dense_forward = _lowrank_and_dense()
    X, Y = _data()
    layer.set_grad_mode("factors")
    ((low(X) - Y) ** 2).sum().backward()
    ((dense_forward(X) - Y) ** 2).sum().backward()
    G, U, V = W.grad, layer.U.detach(), layer.V.detach()
    PU, PV = U @ U.T, V @ V.T
    PT = PU @ G + G @ PV - PU @ G @ PV
    head_sq = sum(float(p.grad.square().sum()) for p in head.parameters())
    bias_sq = float(layer.bias.grad.square().sum())
    want = (float(PT.square().sum()) + head_sq + bias_sq) ** 0.5
    assert abs(float(rankwise.grad_norm(low)) - want) < 1e-10
    full = (float(G.square().sum()) + head_sq + bias_sq) ** 0.5
    assert want < full  # the projection's norm is below the full gradient's
    before = [t.clone() for t in (*layer.factor_grads(), layer.S.grad, low[2].weight.grad)]
    norm = rankwise.clip_grad_norm_(low, want / 4)
    assert abs(float(norm) - want) < 1e-10
    after = (*layer.factor_grads(), layer.S.grad, low[2].weight.grad)
    for b, a in zip(before, after, strict=True):  # one factor for every gradient the step reads
        torch.testing.assert_close(a, b * (want / 4) / (want + 1e-6), atol=1e-13, rtol=0)
    assert abs(float(rankwise.grad_norm(low)) - want / 4) < 1e-6


def test_clipping_inside_a_dlrt_closure_acts_on_its_step():
    """A clipped closure with a threshold far below the norm gives the step of a gradient scaled
    down: the factors move far less than without clipping."""
    moves = []
    for clip in (None, 1e-3):
        low, *_ = _lowrank_and_dense()
        opt = DLRT(low, 0.05, tau=1e-8, adaptive=False)
        X, Y = _data()
        W0 = low[0].weight_matrix().detach().clone()

        def closure(clip=clip, low=low, opt=opt, X=X, Y=Y):
            opt.zero_grad()
            loss = ((low(X) - Y) ** 2).sum()
            loss.backward()
            if clip is not None:
                rankwise.clip_grad_norm_(low, clip)
            return loss

        opt.step(closure)
        moves.append(float((low[0].weight_matrix().detach() - W0).norm()))
    assert moves[1] < moves[0] / 100


def test_bad_threshold_is_refused():
    with pytest.raises(ValueError, match="max_norm"):
        rankwise.clip_grad_norm_(nn.Linear(2, 2), 0.0)
