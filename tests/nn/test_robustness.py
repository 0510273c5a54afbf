"""Regression tests for failure paths: autocast, half precision checkpoints, skipped steps."""

import warnings

import pytest
import torch
from torch import nn

import rankwise
from helpers import F64, mse_closure, rank3_problem
from rankwise import DLRT, SDLRT, LowRankLinear


def test_autocast_backward_matches_float32():
    torch.manual_seed(0)
    m = nn.Sequential(LowRankLinear(16, 8, 4), nn.ReLU(), rankwise.LowRankConv2d(1, 2, 3, 2, padding=1))
    x = torch.randn(5, 16)

    def run(autocast: bool):
        for p in m.parameters():
            p.grad = None
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            y = m[2](m[1](m[0](x)).reshape(5, 1, 2, 4))
        y.float().pow(2).mean().backward()
        return [p.grad.clone() for p in m.parameters()]

    ref, amp = run(False), run(True)
    for a, b in zip(ref, amp, strict=True):
        assert a.dtype == b.dtype == torch.float32
        torch.testing.assert_close(a, b, rtol=0.1, atol=0.05)


@pytest.mark.parametrize("optimizer", ["sgd", "adam"])
def test_half_precision_optimizer_state_round_trip(optimizer):
    def make():
        torch.manual_seed(0)
        return nn.Sequential(LowRankLinear(16, 12, 4), nn.ReLU(), LowRankLinear(12, 3, 2)).to(torch.bfloat16)

    x, y = torch.randn(8, 16, dtype=torch.bfloat16), torch.randn(8, 3, dtype=torch.bfloat16)
    m = make()
    rule = {"momentum": 0.9} if optimizer == "sgd" else {}  # (Adam has no momentum argument)
    opt = DLRT(m, 0.05, tau=0.1, optimizer=optimizer, **rule)
    for _ in range(2):
        opt.step(mse_closure(opt, m, x, y))
    m2 = make()
    m2.load_state_dict(m.state_dict())
    opt2 = DLRT(m2, 0.05, tau=0.1, optimizer=optimizer, **rule)
    opt2.load_state_dict(opt.state_dict())
    assert opt2.state[m2[0].U]["m"].dtype == torch.float32  # working precision restored
    opt2.step(mse_closure(opt2, m2, x, y))


def test_skipped_two_pass_step_restores_factors_and_state():
    X, Y, _ = rank3_problem()
    layer = LowRankLinear(20, 30, 4, dtype=F64)
    opt = SDLRT(layer, 0.1, tau=0.1, momentum=0.9, single_pass=False, on_nonfinite="skip")
    opt.step(mse_closure(opt, layer, X, Y))
    calls = {"n": 0}

    def closure():  # finite on the first pass, NaN on the second
        calls["n"] += 1
        opt.zero_grad()
        loss = ((layer(X) - Y) ** 2).sum(-1).mean() * (1.0 if calls["n"] == 1 else float("nan"))
        loss.backward()
        return loss.detach()

    before = {k: v.clone() for k, v in layer.state_dict().items()}
    K_state = opt.state[layer.U]["m"].clone()
    with pytest.warns(RuntimeWarning, match="skipped"):
        opt.step(closure)
    for k, v in layer.state_dict().items():
        assert torch.equal(v, before[k]), k
    assert torch.equal(opt.state[layer.U]["m"], K_state)  # nothing committed
    opt.step(mse_closure(opt, layer, X, Y))  # and training goes on


def test_load_state_dict_resyncs_update_every_phase():
    X, Y, _ = rank3_problem()
    layer = LowRankLinear(20, 30, 4, dtype=F64)
    opt = DLRT(layer, 0.1, tau=0.1, update_every=2)
    closure = mse_closure(opt, layer, X, Y)
    opt.step(closure)
    opt.step(closure)
    ck = opt.state_dict()  # next step (2) augments
    opt.step(closure)  # step 2; next (3) is core-only
    opt.load_state_dict(ck)
    U = layer.U.clone()
    opt.step(closure)  # must augment again: U changes
    assert not torch.equal(layer.U, U)


def test_exception_in_closure_restores_grad_modes():
    X, Y, _ = rank3_problem()
    layer = LowRankLinear(20, 30, 4, dtype=F64)
    opt = DLRT(layer, 0.1, tau=0.1)

    def bad():
        raise RuntimeError("boom")

    with pytest.raises(RuntimeError, match="boom"):
        opt.step(bad)
    U = layer.U.clone()
    opt.step(mse_closure(opt, layer, X, Y))
    assert not torch.equal(layer.U, U)


def test_large_finite_gradients_are_not_flagged():
    layer = LowRankLinear(16, 512, 4).half()
    opt = DLRT(layer, 1e-6, tau=0.1)
    x = torch.randn(4, 16, dtype=torch.float16)

    def closure():
        opt.zero_grad()
        loss = (layer(x) * 20).sum() / 2  # bias grad sums to > 65504 in float16
        loss.backward()
        return loss.detach()

    opt.step(closure)


def test_to_low_rank_leaves_unsupported_same_padding_dense():
    model = nn.Sequential(nn.Conv2d(2, 4, 4, padding="same"), nn.Conv2d(4, 4, 3, padding="same"))
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        rankwise.to_low_rank(model, rank=2)
    assert type(model[0]) is nn.Conv2d and isinstance(model[1], rankwise.LowRankConv2d)
    assert any("leaving '0' dense" in str(x.message) for x in w)
    x = torch.randn(1, 2, 6, 6)
    assert model(x).shape == (1, 4, 6, 6)


def test_grad_scaler_step_equals_unscaled_training():
    def run(enabled: bool):
        torch.manual_seed(0)
        layer = LowRankLinear(20, 30, 4, dtype=torch.float32)
        X, Y, _ = rank3_problem()
        X, Y = X.float(), Y.float()
        opt = SDLRT(layer, 0.05, tau=0.1, momentum=0.9)
        scaler = torch.amp.GradScaler("cpu", init_scale=1024.0, enabled=enabled)
        for _ in range(3):
            opt.zero_grad()
            scaler.scale(((layer(X) - Y) ** 2).sum(-1).mean()).backward()
            scaler.step(opt)
            scaler.update()
        return layer.weight_matrix().detach()

    torch.testing.assert_close(run(True), run(False), rtol=1e-4, atol=1e-5)


def test_grad_scaler_skips_steps_with_inf():
    layer = LowRankLinear(8, 6, 2)
    opt = DLRT(layer, 0.1, tau=0.1)
    scaler = torch.amp.GradScaler("cpu", init_scale=1e38)
    x = torch.randn(4, 8)
    W = layer.weight_matrix().detach().clone()
    opt.zero_grad()
    scaler.scale((layer(x) * 1e3).sum()).backward()  # overflows at this scale
    scaler.step(opt)
    scaler.update()
    assert torch.equal(layer.weight_matrix().detach(), W) and scaler.get_scale() < 1e38
