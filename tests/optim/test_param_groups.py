"""Param groups: each group's hyperparameters reach the parameters it holds (low-rank layers and
dense ones, batched and per-layer paths), checked against runs without groups and against the
plain update rule; bad groups are refused with a message naming the problem."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from rankwise import DLRT, SDLRT, LowRankLinear

F64 = torch.float64


def _model(seed: int = 0) -> nn.Sequential:
    torch.manual_seed(seed)
    return nn.Sequential(LowRankLinear(12, 10, rank=3, dtype=F64), nn.Tanh(),
                         LowRankLinear(10, 12, rank=3, dtype=F64), nn.Tanh(),
                         nn.Linear(12, 4, dtype=F64)).to(F64)


def _data():
    g = torch.Generator().manual_seed(1)
    return torch.randn(32, 12, generator=g, dtype=F64), torch.randn(32, 4, generator=g, dtype=F64)


def _steps(opt, model, n: int = 3):
    X, Y = _data()

    def closure():
        opt.zero_grad()
        loss = ((model(X) - Y) ** 2).mean()
        loss.backward()
        return loss

    for _ in range(n):
        opt.step(closure)


def _weight(layer) -> torch.Tensor:
    return (layer.U @ layer.S @ layer.V.T).detach().clone()


PATHS = [dict(), dict(single_pass=False), dict(update_every=2)]  # batched; per-layer; core steps


@pytest.mark.parametrize("kw", PATHS, ids=["batched", "two-pass", "update-every"])
@pytest.mark.parametrize("optimizer", ["sgd", "adam"])
def test_groups_with_the_defaults_change_nothing(kw, optimizer):
    """Splitting the parameters into groups that carry the default values gives bitwise the run
    without groups."""
    a, b = _model(), _model()
    opt_a = DLRT(a, 0.05, tau=0.05, optimizer=optimizer, **kw)
    opt_b = DLRT(b, 0.05, tau=0.05, optimizer=optimizer, param_groups=[
        {"params": b[4].parameters()}, {"params": [b[2].S], "lr": 0.05}], **kw)
    assert len(opt_b.param_groups) == 3 and len(opt_b.param_groups[2]["params"]) == 3  # U, S, V together
    _steps(opt_a, a)
    _steps(opt_b, b)
    for pa, pb in zip(a.parameters(), b.parameters(), strict=True):
        assert torch.equal(pa, pb)


@pytest.mark.parametrize("kw", PATHS, ids=["batched", "two-pass", "update-every"])
@pytest.mark.parametrize("cls", [DLRT, SDLRT])
def test_a_frozen_group_keeps_its_layer_and_the_rest_trains_as_without_it(kw, cls):
    """lr = 0 in the second layer's group: its weight stays (up to roundoff of the basis
    change); on the first step the first layer moves exactly as in a run with one group."""
    ref, model = _model(), _model()
    opt_ref = cls(ref, 0.05, tau=0.05, momentum=0.9, **kw)
    frozen = [{"params": model[2].parameters(), "lr": 0.0}]
    opt = cls(model, 0.05, tau=0.05, momentum=0.9, param_groups=frozen, **kw)
    W2 = _weight(model[2])
    _steps(opt_ref, ref, 1)
    _steps(opt, model, 1)
    torch.testing.assert_close(_weight(model[0]), _weight(ref[0]), atol=1e-12, rtol=0)
    assert not torch.allclose(_weight(ref[2]), W2, atol=1e-6)  # it does move at the default lr
    _steps(opt, model, 3)
    torch.testing.assert_close(_weight(model[2]), W2, atol=1e-12, rtol=0)


@pytest.mark.parametrize("kw", PATHS, ids=["batched", "two-pass", "update-every"])
def test_a_dense_groups_rate_and_weight_decay_are_its_own(kw):
    """The head's group (lr 0.2, weight decay 0.1; default lr 0.05): its first SGD step is
    −0.2·(g + 0.1·p), the plain rule at the group's values."""
    model = _model()
    opt = DLRT(model, 0.05, tau=0.05, param_groups=[
        {"params": model[4].parameters(), "lr": 0.2, "weight_decay": 0.1}], **kw)
    X, Y = _data()
    before = [p.detach().clone() for p in model[4].parameters()]
    opt.zero_grad()
    ((model(X) - Y) ** 2).mean().backward()
    grads = [p.grad.clone() for p in model[4].parameters()]
    opt.zero_grad()
    _steps(opt, model, 1)
    for p, p0, g in zip(model[4].parameters(), before, grads, strict=True):
        torch.testing.assert_close(p.detach(), p0 - 0.2 * (g + 0.1 * p0), atol=1e-14, rtol=0)


def test_a_scheduler_scales_every_group_and_add_param_group_works():
    model = _model()
    opt = DLRT(model, 0.1, tau=0.05, param_groups=[{"params": model[4].parameters(), "lr": 0.01}])
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda step: 0.5 ** step)
    _steps(opt, model, 1)
    sched.step()
    assert [g["lr"] for g in opt.param_groups] == [0.05, 0.005]
    assert "global_step" in opt.param_groups[0] and "global_step" not in opt.param_groups[1]
    extra = nn.Parameter(torch.zeros(3, dtype=F64))
    opt.add_param_group({"params": [extra], "lr": 0.3})
    assert opt.param_groups[-1]["momentum"] == 0.0
    state = opt.state_dict()
    fresh = DLRT(model, 0.1, tau=0.05, param_groups=[{"params": model[4].parameters(), "lr": 0.01}])
    fresh.add_param_group({"params": [extra]})
    fresh.load_state_dict(state)
    assert [g["lr"] for g in fresh.param_groups] == [0.05, 0.005, 0.3]


def test_bad_groups_are_refused_with_the_problem_named():
    model = _model()
    with pytest.raises(ValueError, match="not a trainable parameter"):
        DLRT(model, 0.1, tau=0.05, param_groups=[{"params": [nn.Parameter(torch.zeros(2))]}])
    with pytest.raises(ValueError, match="U, S and V share a group"):
        DLRT(model, 0.1, tau=0.05, param_groups=[{"params": [model[0].U]}, {"params": [model[0].V]}])
    with pytest.raises(ValueError, match="momentum"):
        DLRT(model, 0.1, tau=0.05, param_groups=[{"params": model[4].parameters(), "momentum": 1.0}])
    with pytest.raises(ValueError, match="but the rule is SGD"):
        DLRT(model, 0.1, tau=0.05, param_groups=[{"params": model[4].parameters(), "betas": (0.9, 0.9)}])
    with pytest.raises(TypeError, match="list of dicts"):
        DLRT(model, 0.1, tau=0.05, param_groups=[model[4].weight])
    opt = DLRT(model, 0.1, tau=0.05, param_groups=[{"params": model[4].parameters()}])
    with pytest.raises(ValueError, match="`lr` must be a finite number"):
        opt.add_param_group({"params": [nn.Parameter(torch.zeros(2))], "lr": float("nan")})


@pytest.mark.parametrize("kw", PATHS, ids=["batched", "two-pass", "update-every"])
def test_moments_reset_equals_clearing_the_layer_states_after_every_augmentation(kw):
    """``moments="reset"``: each truncation starts the rule afresh in the new bases; the same
    as a default (rotating) run whose layer states are cleared after every augmenting step."""
    a, b = _model(), _model()
    opt_a = DLRT(a, 0.01, tau=0.05, optimizer="adam", moments="reset", **kw)
    opt_b = DLRT(b, 0.01, tau=0.05, optimizer="adam", **kw)
    every = kw.get("update_every", 1)
    for step in range(4):
        _steps(opt_a, a, 1)
        _steps(opt_b, b, 1)
        if step % every == 0:
            for m in (b[0], b[2]):
                for p in (m.U, m.V, m.S):  # the rule states (K's under U, L's under V, S's under S)
                    for k in ("m", "v", "step"):
                        opt_b.state[p].pop(k, None)
    for pa, pb in zip(a.parameters(), b.parameters(), strict=True):
        assert torch.equal(pa, pb)
    assert "m" not in opt_a.state[a[0].U] or every > 1
    with pytest.raises(ValueError, match="moments"):
        DLRT(a, 0.01, tau=0.05, moments="project")


@pytest.mark.parametrize("kw", PATHS, ids=["batched", "two-pass", "update-every"])
def test_core_lr_ratio_scales_only_the_cores_step(kw):
    """Plain SGD: ΔS = −lr·ratio·G_S, so ratio 2 equals the default run whose closure doubles the
    cores' gradients (and only theirs: K, L and the dense steps are the same)."""
    a, b = _model(), _model()
    opt_a = DLRT(a, 0.05, tau=0.05, core_lr_ratio=2.0, **kw)
    opt_b = DLRT(b, 0.05, tau=0.05, **kw)
    X, Y = _data()
    for opt, model, double in ((opt_a, a, False), (opt_b, b, True)):
        def closure(opt=opt, model=model, double=double):
            opt.zero_grad()
            loss = ((model(X) - Y) ** 2).mean()
            loss.backward()
            if double:
                for m in (model[0], model[2]):
                    m.S.grad.mul_(2)
            return loss
        for _ in range(3):
            opt.step(closure)
    for pa, pb in zip(a.parameters(), b.parameters(), strict=True):
        torch.testing.assert_close(pa, pb, atol=1e-13, rtol=0)
    with pytest.raises(ValueError, match="core_lr_ratio"):
        DLRT(a, 0.05, tau=0.05, core_lr_ratio=0.0)
