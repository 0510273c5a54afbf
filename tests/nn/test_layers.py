"""LowRankLinear / LowRankConv2d against dense PyTorch layers (float64)."""

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn

import rankwise
from helpers import F64
from rankwise import LowRankConv2d, LowRankLinear


def test_linear_forward_and_grads_match_dense():
    layer = LowRankLinear(12, 9, 4, dtype=F64)
    x = torch.randn(5, 3, 12, dtype=F64, requires_grad=True)
    y = layer(x)
    W = layer.dense_weight()
    assert W.shape == (9, 12)
    torch.testing.assert_close(y, F.linear(x, W, layer.bias))
    # gradients of every input against plain autograd through U @ S @ V.T
    U, S, V = (t.detach().clone().requires_grad_(True) for t in (layer.U, layer.S, layer.V))
    x2 = x.detach().clone().requires_grad_(True)
    g = torch.randn_like(y)
    (F.linear(x2, U @ S @ V.T, layer.bias) * g).sum().backward()
    (y * g).sum().backward()
    for a, b in [(x.grad, x2.grad), (layer.U.grad, U.grad), (layer.S.grad, S.grad),
                 (layer.V.grad, V.grad)]:
        torch.testing.assert_close(a, b)


@pytest.mark.parametrize("stride,padding,dilation",
                         [(1, 0, 1), (2, 1, 1), (1, 2, 2), ((2, 1), (1, 0), (1, 2))])
def test_conv_forward_and_grads_match_dense(stride, padding, dilation):
    layer = LowRankConv2d(3, 7, (3, 2), 4, stride=stride, padding=padding, dilation=dilation, dtype=F64)
    x = torch.randn(2, 3, 7, 6, dtype=F64)
    W = layer.dense_weight()
    assert W.shape == (7, 3, 3, 2) and layer.V.shape == (3 * 3 * 2, 4)
    torch.testing.assert_close(layer(x), F.conv2d(x, W, layer.bias, stride, padding, dilation))
    fn = lambda x, U, S, V, b: rankwise.nn._autograd.LowRankConv2dFn.apply(  # noqa: E731
        x, U, S, V, b, False, layer.kernel_size, layer.stride, layer.padding, layer.dilation)
    args = [t.detach().clone().requires_grad_(True) for t in (x[:1], layer.U, layer.S, layer.V, layer.bias)]
    assert torch.autograd.gradcheck(fn, args, fast_mode=True)


def test_linear_gradcheck():
    layer = LowRankLinear(6, 5, 3, dtype=F64)
    fn = lambda x, U, S, V, b: rankwise.nn._autograd.LowRankLinearFn.apply(  # noqa: E731
        x, U, S, V, b, False)
    args = [t.detach().clone().requires_grad_(True)
            for t in (torch.randn(4, 6, dtype=F64), layer.U, layer.S, layer.V, layer.bias)]
    assert torch.autograd.gradcheck(fn, args)


@pytest.mark.parametrize("kind", ["linear", "conv"])
def test_factor_grads_are_dense_gradient_times_bases(kind):
    """G_K = ∇_W·V and G_L = ∇_Wᵀ·U, with ∇_W from dense autograd."""
    if kind == "linear":
        layer, x = LowRankLinear(10, 8, 3, dtype=F64), torch.randn(16, 10, dtype=F64)
        dense = lambda W: F.linear(x, W, layer.bias)  # noqa: E731
    else:
        layer = LowRankConv2d(2, 5, 3, 3, padding=1, stride=2, dtype=F64)
        x = torch.randn(3, 2, 7, 7, dtype=F64)
        dense = lambda W: F.conv2d(x, W.reshape(5, 2, 3, 3), layer.bias, 2, 1)  # noqa: E731
    layer.set_grad_mode("factors")
    (layer(x) ** 2).sum().backward()
    gk, gl = layer.factor_grads()
    W = layer.weight_matrix().detach().clone().requires_grad_(True)
    (gW,) = torch.autograd.grad((dense(W) ** 2).sum(), W)
    torch.testing.assert_close(gk, gW @ layer.V.detach())
    torch.testing.assert_close(gl, gW.T @ layer.U.detach())
    torch.testing.assert_close(layer.S.grad, layer.U.detach().T @ gW @ layer.V.detach())
    assert layer.U.grad is gk and layer.V.grad is gl  # factor mode: G_K, G_L are U's and V's .grad
    layer.set_grad_mode("core")
    layer.reset_factor_grads()
    layer.S.grad = None
    (layer(x) ** 2).sum().backward()
    assert layer.factor_grads() == (None, None)
    torch.testing.assert_close(layer.S.grad, layer.U.detach().T @ gW @ layer.V.detach())


def test_conv_never_unfolds(monkeypatch):
    def boom(*a, **k):
        raise AssertionError("unfold was called")

    monkeypatch.setattr(F, "unfold", boom)
    monkeypatch.setattr(torch.Tensor, "unfold", boom)
    layer = LowRankConv2d(3, 4, 3, 2, padding=1)
    layer.set_grad_mode("factors")
    layer(torch.randn(2, 3, 6, 6)).sum().backward()


@pytest.mark.parametrize("rank", [1, 3, 7])
def test_from_dense_error_is_discarded_tail(rank):
    lin = nn.Linear(9, 7).double()
    low = LowRankLinear.from_dense(lin, rank=rank)
    s = np.linalg.svd(lin.weight.detach().numpy(), compute_uv=False)
    err = torch.linalg.matrix_norm(low.dense_weight() - lin.weight).item()
    assert low.rank == rank
    assert err == pytest.approx(np.sqrt((s[rank:] ** 2).sum()), abs=1e-12)
    torch.testing.assert_close(low.bias, lin.bias)


def test_from_dense_tau_picks_smallest_rank():
    conv = nn.Conv2d(4, 6, 3).double()
    s = np.linalg.svd(conv.weight.detach().reshape(6, -1).numpy(), compute_uv=False)
    tail = np.sqrt(np.cumsum((s**2)[::-1])[::-1])  # tail[r] = ||s[r:]||
    for tau in (0.05, 0.3, 0.6):
        low = LowRankConv2d.from_dense(conv, tau=tau)
        r = low.rank
        assert tail[r] <= tau * np.linalg.norm(s) if r < len(s) else True
        assert tail[r - 1] > tau * np.linalg.norm(s)
        err = torch.linalg.vector_norm(low.dense_weight() - conv.weight).item()
        assert err == pytest.approx(tail[r] if r < len(s) else 0.0, abs=1e-12)


def test_to_low_rank_clamps_filters_and_keeps_function():
    model = nn.Sequential(nn.Conv2d(2, 4, 3, padding=1), nn.ReLU(), nn.Flatten(), nn.Linear(64, 3)).double()
    x = torch.randn(5, 2, 4, 4, dtype=F64)
    ref = model(x)
    rankwise.to_low_rank(model, rank=1000)
    assert isinstance(model[0], LowRankConv2d) and isinstance(model[3], LowRankLinear)
    assert model[0].rank == 4 and model[3].rank == 3  # clamped to min(out, in)
    torch.testing.assert_close(model(x), ref)
    m2 = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 8))
    rankwise.to_low_rank(m2, rank=2, exclude=["1"])
    assert isinstance(m2[0], LowRankLinear) and type(m2[1]) is nn.Linear
    m3 = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 8))
    rankwise.to_low_rank(m3, rank=2, include=r"1")
    assert type(m3[0]) is nn.Linear and isinstance(m3[1], LowRankLinear)
    with pytest.raises(ValueError, match="rank"):
        rankwise.to_low_rank(nn.Linear(3, 3))


def test_bad_arguments_are_named():
    with pytest.raises(ValueError, match=r"`rank` must be in \[1, 4\]"):
        LowRankLinear(4, 6, 5)
    with pytest.raises(ValueError, match="expected input"):
        LowRankLinear(4, 6, 2)(torch.randn(3, 5))
    with pytest.raises(ValueError, match="padding"):
        LowRankConv2d(2, 2, 3, 1, padding="full")
    with pytest.raises(ValueError, match="tau"):
        LowRankLinear.from_dense(nn.Linear(3, 3), tau=1.5)
