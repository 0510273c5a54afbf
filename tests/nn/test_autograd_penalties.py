"""Issue 56: gradient penalties (create_graph=True) in factor and full mode, torch.func over a
low-rank model, and the output dtype under autocast; each against a dense float64 reference
(nn.Linear / F.conv2d with the weight U S Vᵀ as one leaf)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.func import functional_call, grad, hessian, jacfwd, jacrev, vmap

from helpers import F64
from rankwise import LowRankConv2d, LowRankLinear
from rankwise.nn import LowRankConv1D, LowRankMultiheadAttention


def _layer(kind: str):
    """(a float64 low-rank layer, an input, dense(x, W) with W (out, in) the weight matrix)."""
    if kind == "linear":
        layer = LowRankLinear(6, 5, 3, dtype=F64)
        return layer, torch.randn(4, 6, dtype=F64), lambda x, W, b: F.linear(x, W, b)
    if kind == "conv1d":  # HF Conv1D's low-rank form (nf=5, nx=6): the same Function as Linear
        layer = LowRankConv1D(5, 6, 3, dtype=F64)
        return layer, torch.randn(2, 3, 6, dtype=F64), lambda x, W, b: F.linear(x, W, b)
    layer = LowRankConv2d(2, 3, 3, 2, stride=2, padding=1, dtype=F64)
    return (layer, torch.randn(2, 2, 5, 5, dtype=F64),
            lambda x, W, b: F.conv2d(x, W.reshape(3, 2, 3, 3), b, 2, 1))


def _expected(mode, gW, U, S, V):
    """What (U.grad, S.grad, V.grad) must be for ∇_W L = gW: factor mode (G_K, G_S, G_L), else
    the true gradients."""
    gk, gs, gl = gW @ V, U.T @ gW @ V, gW.T @ U
    return (gk, gs, gl) if mode == "factors" else (gk @ S.T, gs, gl @ S)


@pytest.mark.parametrize("mode", ["factors", "full"])
@pytest.mark.parametrize("kind", ["linear", "conv", "conv1d"])
def test_a_gradient_penalty_reaches_the_factors_in_their_form(kind, mode):
    """WGAN-GP / R1: L = D(x).mean() + λ‖∂D/∂x‖² with create_graph=True. U.grad, S.grad, V.grad
    are (G_K, G_S, G_L) of the whole L in factor mode and the true gradients in full mode (the
    penalty's share used to reach U and V as a true gradient in factor mode: 7–60 % off)."""
    layer, x, dense = _layer(kind)
    layer.set_grad_mode(mode)
    head = torch.randn(*([3, 1, 1] if kind == "conv" else [5]), dtype=F64)

    def loss_of(f):
        xr = x.clone().requires_grad_(True)
        out = (torch.tanh(f(xr)) * head).sum()
        (gx,) = torch.autograd.grad(out, xr, create_graph=True)
        return out / 4 + 10 * (gx**2).sum()

    loss_of(layer).backward()
    W = layer.weight_matrix().detach().clone().requires_grad_(True)
    b = layer.bias.detach().clone().requires_grad_(True)
    loss_of(lambda x: dense(x, W, b)).backward()
    U, S, V = (t.detach() for t in (layer.U, layer.S, layer.V))
    for got, want in zip((layer.U.grad, layer.S.grad, layer.V.grad), _expected(mode, W.grad, U, S, V),
                         strict=True):
        torch.testing.assert_close(got, want)
    torch.testing.assert_close(layer.bias.grad, b.grad)


@pytest.mark.parametrize("kind", ["linear", "conv"])
def test_a_penalty_on_the_parameter_gradients_is_differentiated_through_x_v(kind):
    """Full mode, L + ‖∇_θ L‖² with create_graph=True over the parameters (gradient-norm
    regularisation): the backward's intermediate x V is recomputed inside the graph (it was
    saved as a constant: the penalty's share through it was lost)."""
    layer, x, dense = _layer(kind)

    def total(f, params):
        loss = torch.tanh(f(x)).pow(2).sum()
        grads = torch.autograd.grad(loss, params, create_graph=True)
        return loss + sum((g**2).sum() for g in grads)

    total(layer, [layer.U, layer.S, layer.V]).backward()
    U, S, V = (t.detach().clone().requires_grad_(True) for t in (layer.U, layer.S, layer.V))
    total(lambda x: dense(x, U @ S @ V.T, layer.bias), [U, S, V]).backward()
    for got, want in zip((layer.U.grad, layer.S.grad, layer.V.grad), (U.grad, S.grad, V.grad), strict=True):
        torch.testing.assert_close(got, want)


def _mlp_and_reference():
    torch.manual_seed(0)
    model = nn.Sequential(LowRankLinear(6, 5, 3, dtype=F64), nn.Tanh(), LowRankLinear(5, 2, 2, dtype=F64))
    params = {k: v.detach() for k, v in model.named_parameters()}

    def reference(p, x):  # nn.Linear's functional form with the weight U S Vᵀ
        h = F.linear(x, p["0.U"] @ p["0.S"] @ p["0.V"].T, p["0.bias"]).tanh()
        return F.linear(h, p["2.U"] @ p["2.S"] @ p["2.V"].T, p["2.bias"])

    return model, params, reference


def _close(a, b):
    if isinstance(a, dict):
        assert a.keys() == b.keys()
        for k in a:
            _close(a[k], b[k])
    else:
        torch.testing.assert_close(a, b)


@pytest.mark.parametrize("transform", ["grad", "per_sample", "jacrev", "jacfwd", "hessian"])
def test_torch_func_over_a_low_rank_mlp_matches_the_dense_reference(transform):
    """torch.func over functional_call (was "must override setup_context"): grad, the Opacus
    per-sample recipe vmap(grad(loss), in_dims=(None, 0, 0)), jacrev and jacfwd in x and in the
    parameters, and hessian, each equal to the same computation on nn.Linear's F.linear."""
    model, params, reference = _mlp_and_reference()
    x, y = torch.randn(4, 6, dtype=F64), torch.randn(4, 2, dtype=F64)

    def loss(p, x, y):
        return ((functional_call(model, p, (x,)) - y) ** 2).mean()

    def ref_loss(p, x, y):
        return ((reference(p, x) - y) ** 2).mean()

    if transform == "grad":
        _close(grad(loss)(params, x, y), grad(ref_loss)(params, x, y))
    elif transform == "per_sample":
        per_sample = vmap(grad(loss), in_dims=(None, 0, 0))(params, x[:, None], y[:, None])
        assert per_sample["0.U"].shape == (4, 5, 3)
        _close(per_sample, vmap(grad(ref_loss), in_dims=(None, 0, 0))(params, x[:, None], y[:, None]))
    elif transform == "hessian":
        _close(hessian(lambda x: loss(params, x, y))(x[0]), hessian(lambda x: ref_loss(params, x, y))(x[0]))
    else:
        jac = {"jacrev": jacrev, "jacfwd": jacfwd}[transform]
        _close(jac(lambda x: functional_call(model, params, (x,)))(x), jac(lambda x: reference(params, x))(x))
        _close(jac(lambda p: functional_call(model, p, (x,)))(params), jac(lambda p: reference(p, x))(params))


@pytest.mark.parametrize("transform", ["per_sample", "jacrev", "jacfwd", "hessian"])
def test_torch_func_over_a_low_rank_conv_matches_the_dense_reference(transform):
    layer, x, dense = _layer("conv")
    params = {k: v.detach() for k, v in layer.named_parameters()}

    def ref(p, x):
        return dense(x, p["U"] @ p["S"] @ p["V"].T, p["bias"])

    def loss(p, x):
        return (functional_call(layer, p, (x[None],)) ** 2).sum()

    def ref_loss(p, x):
        return (ref(p, x[None]) ** 2).sum()

    if transform == "per_sample":
        per_sample = vmap(grad(loss), in_dims=(None, 0))
        _close(per_sample(params, x), vmap(grad(ref_loss), in_dims=(None, 0))(params, x))
    elif transform == "jacrev":
        _close(jacrev(lambda x: functional_call(layer, params, (x,)))(x), jacrev(lambda x: ref(params, x))(x))
    elif transform == "jacfwd":
        _close(jacfwd(lambda p: functional_call(layer, p, (x,)))(params), jacfwd(lambda p: ref(p, x))(params))
    else:
        _close(hessian(lambda p: loss(p, x[0]))(params), hessian(lambda p: ref_loss(p, x[0]))(params))


def test_torch_func_grad_in_factor_mode_gives_the_factor_gradients():
    """The contract holds under torch.func too: in factor mode grad gives U ∇W·V, V ∇Wᵀ·U."""
    layer, x, dense = _layer("linear")
    layer.set_grad_mode("factors")
    params = {k: v.detach() for k, v in layer.named_parameters()}
    g = grad(lambda p: functional_call(layer, p, (x,)).pow(2).sum())(params)
    W = layer.weight_matrix().detach().clone().requires_grad_(True)
    dense(x, W, layer.bias).pow(2).sum().backward()
    U, S, V = (params[k] for k in "USV")
    _close((g["U"], g["S"], g["V"]), _expected("factors", W.grad, U, S, V))


def _dense_and_low_rank(kind: str):
    torch.manual_seed(0)
    if kind == "linear":
        dense, x = nn.Linear(8, 6), torch.randn(3, 8)
        return dense, LowRankLinear.from_dense(dense, rank=2), (x,)
    if kind == "conv":
        dense, x = nn.Conv2d(3, 5, 3, padding=1), torch.randn(2, 3, 6, 6)
        return dense, LowRankConv2d.from_dense(dense, rank=2), (x,)
    if kind == "conv1d":  # HF Conv1D computes x @ weight + bias: nn.Linear's autocast dtype
        dense, x = nn.Linear(8, 6), torch.randn(3, 8)
        return dense, LowRankConv1D(6, 8, 2), (x,)
    dense, x = nn.MultiheadAttention(8, 2, batch_first=True), torch.randn(2, 4, 8)
    return dense, LowRankMultiheadAttention.from_dense(dense, rank=2), (x, x, x)


@pytest.mark.parametrize("kind", ["linear", "conv", "conv1d", "attention"])
def test_autocast_output_dtype_is_the_dense_layers(kind):
    """Under autocast(bfloat16) a low-rank layer with a bias returns what the dense layer returns
    (bf16; the bias used to promote it to float32, so everything downstream ran and was saved in
    float32), and the backward gives float32 gradients to the float32 parameters."""
    dense, low, args = _dense_and_low_rank(kind)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        want, got = dense(*args), low(*args)
        if kind == "attention":
            want, got = want[0], got[0]
    assert want.dtype == torch.bfloat16
    assert got.dtype == want.dtype
    got.float().pow(2).mean().backward()
    for p in low.parameters():
        assert p.grad is not None and p.grad.dtype == torch.float32 and p.grad.isfinite().all()


@pytest.mark.parametrize("mode", ["factors", "full"])
def test_a_gradient_penalty_inside_autocast_matches_float32(mode):
    """The penalty's torch.autograd.grad(create_graph=True) written inside the autocast region:
    the backward runs in the factors' dtype (a conv layer's used to end in a oneDNN error from the
    mixed dtypes autocast made), and the gradients are float32's within bf16's precision."""
    torch.manual_seed(0)
    model = nn.Sequential(LowRankLinear(16, 12, 2), nn.Tanh(), nn.Unflatten(1, (3, 2, 2)),
                          LowRankConv2d(3, 2, 3, 2, padding=1))
    for layer in (model[0], model[3]):
        layer.set_grad_mode(mode)
    x = torch.randn(8, 16)

    def grads(autocast: bool):
        model.zero_grad()
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            xr = x.clone().requires_grad_(True)
            out = model(xr).float().sum()
            (gx,) = torch.autograd.grad(out, xr, create_graph=True)
            loss = out + (gx.float() ** 2).sum()
        loss.backward()
        return [p.grad.clone() for p in model.parameters()]

    for got, want in zip(grads(True), grads(False), strict=True):
        assert got.dtype == torch.float32
        torch.testing.assert_close(got, want, rtol=0.05, atol=0.05)
