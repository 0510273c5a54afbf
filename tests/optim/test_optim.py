"""DLRT / SDLRT optimizers: exactness properties, convergence, state handling."""

import pytest
import torch
from torch import nn

import rankwise
from helpers import F64, dense_grad, mse_closure, projector, rank3_problem, step_beside_torch
from rankwise import DLRT, SDLRT, LowRankConv2d, LowRankLinear
from rankwise.optim.rules._rules import adam, sgd, transport

BOTH = [True, False]  # single_pass


def _net(dtype=F64):
    return nn.Sequential(LowRankConv2d(2, 6, 3, 3, padding=1, dtype=dtype), nn.ReLU(), nn.Flatten(),
                         LowRankLinear(6 * 16, 8, 4, dtype=dtype), nn.LayerNorm(8, dtype=dtype),
                         LowRankLinear(8, 3, 2, dtype=dtype))


def _data(dtype=F64):
    return torch.randn(10, 2, 4, 4, dtype=dtype), torch.randn(10, 3, dtype=dtype)


def _warm_buffers(model, X, Y, cls=SDLRT):
    opt = cls(model, 0.05, tau=0.3)
    for _ in range(3):
        opt.step(mse_closure(opt, model, X, Y))


@pytest.mark.parametrize("single_pass", BOTH)
@pytest.mark.parametrize("cls,kw", [(DLRT, {"adaptive": False}), (SDLRT, {"tau": 0.0}),
                                    (SDLRT, {"adaptive": False, "momentum": 0.9})])
def test_zero_lr_step_leaves_weights_unchanged(single_pass, cls, kw):
    """Galerkin exactness: with lr = 0 the augmented core reconstructs every weight."""
    model, (X, Y) = _net(), _data()
    _warm_buffers(model, X, Y)  # non-empty compensation buffers
    before = [m.dense_weight().clone() for m in model if isinstance(m, rankwise.AbstractLowRankLayer)]
    kw = {"tau": 0.3, **kw}
    opt = cls(model, 0.0, single_pass=single_pass, **kw)
    opt.step(mse_closure(opt, model, X, Y))
    after = [m.dense_weight() for m in model if isinstance(m, rankwise.AbstractLowRankLayer)]
    for a, b in zip(before, after, strict=True):
        torch.testing.assert_close(a, b, atol=1e-12, rtol=0)


@pytest.mark.parametrize("single_pass", BOTH)
def test_one_step_matches_projector_reference(single_pass):
    """Without truncation (τ = 0) one SGD step is W0 − lr·P(∇W) with P the tangent projection
    (single pass) or the projection onto the augmented spaces, P_Ū ∇ P_V̄ (two-pass BUG);
    projectors built by numpy from span[U0, ∇V0] and span[V0, ∇ᵀU0]."""
    X, Y, _ = rank3_problem()
    layer = LowRankLinear(20, 30, 4, bias=False, dtype=F64)
    W0, U0, V0 = layer.weight_matrix().detach().clone(), layer.U.detach().clone(), layer.V.detach().clone()
    G = dense_grad(layer, X, Y)
    lr = 0.1
    opt = DLRT(layer, lr, tau=0.0, single_pass=single_pass, max_rank=20)
    opt.step(mse_closure(opt, layer, X, Y))
    PU, PV = projector(U0), projector(V0)
    if single_pass:
        ref = W0 - lr * (PU @ G + G @ PV - PU @ G @ PV)
    else:
        PUb, PVb = projector(torch.cat([U0, G @ V0], 1)), projector(torch.cat([V0, G.T @ U0], 1))
        ref = W0 - lr * PUb @ G @ PVb
    torch.testing.assert_close(layer.weight_matrix(), ref, atol=1e-10, rtol=0)
    assert 4 < layer.rank <= 8


def _fit_rank3(cls, steps: int = 300, **kw):
    """300 steps on the rank-3 regression from rank 8: (layer, optimizer, first loss, last loss)."""
    X, Y, _ = rank3_problem()
    layer = LowRankLinear(20, 30, 8, bias=False, dtype=F64)
    opt = cls(layer, 0.2, tau=0.05, **kw)
    closure = mse_closure(opt, layer, X, Y)
    first = float(closure())
    for _ in range(steps):
        loss = opt.step(closure)
    return layer, opt, first, loss


@pytest.mark.parametrize("single_pass", BOTH)
def test_fixed_rank_stays_fixed(single_pass):
    X, Y, _ = rank3_problem()
    layer = LowRankLinear(20, 30, 4, dtype=F64)
    opt = SDLRT(layer, 0.05, tau=0.1, adaptive=False, single_pass=single_pass)
    for _ in range(4):
        opt.step(mse_closure(opt, layer, X, Y))
        assert layer.rank == 4 and layer.U_buf.shape[1] == 4


@pytest.mark.parametrize("single_pass", BOTH)
@pytest.mark.parametrize("cls,kw", [(DLRT, {}), (SDLRT, {"feedback": False})])
def test_rank3_regression_reaches_zero_loss_at_rank3(cls, kw, single_pass):
    layer, _, first, loss = _fit_rank3(cls, single_pass=single_pass, **kw)
    assert float(loss) < 1e-6 * first
    assert layer.rank == 3


@pytest.mark.parametrize("single_pass", BOTH)
def test_default_sdlrt_reaches_zero_loss_with_decaying_tau(single_pass):
    """Default SDLRT: the rank (3, the target's) stays below the initial rank 8, so the feedback
    fires on every step and τ decays as ω^t; the numerical-rank guard keeps roundoff
    directions out of the rank even when τ has reached ~0."""
    layer, opt, first, loss = _fit_rank3(SDLRT, single_pass=single_pass)
    assert float(loss) < 1e-6 * first
    assert layer.rank == 3
    assert opt.taus()[""] <= 0.05 * 0.8**290


def test_tau_feedback_fires_exactly_when_rank_below_initial():
    X, Y, _ = rank3_problem()
    layer = LowRankLinear(20, 30, 8, bias=False, dtype=F64)
    opt = SDLRT(layer, 0.2, tau=0.3, omega=0.8, tau_min=1e-3)
    closure = mse_closure(opt, layer, X, Y)
    fired = 0
    for _ in range(40):
        tau = opt.taus()[""]
        opt.step(closure)
        expect = max(0.8 * tau, 1e-3) if layer.rank < 8 else tau
        assert opt.taus()[""] == pytest.approx(expect, rel=1e-15)
        fired += layer.rank < 8
    assert fired > 0  # the scenario exercises both branches
    opt2 = SDLRT(layer, 0.2, tau=0.3, feedback=False)
    for _ in range(5):
        opt2.step(closure)
    assert opt2.taus()[""] == 0.3


def test_update_every_only_moves_cores_in_between():
    X, Y, _ = rank3_problem()
    layer = LowRankLinear(20, 30, 5, dtype=F64)
    opt = DLRT(layer, 0.05, tau=0.1, update_every=3)
    closure = mse_closure(opt, layer, X, Y)
    opt.step(closure)  # step 0 augments
    U, V, b = layer.U.clone(), layer.V.clone(), layer.bias.clone()
    for _ in range(2):  # steps 1, 2: cores and dense parameters only
        S = layer.S.clone()
        opt.step(closure)
        assert torch.equal(layer.U, U) and torch.equal(layer.V, V)
        assert not torch.equal(layer.S, S)
    assert not torch.equal(layer.bias, b)
    opt.step(closure)  # step 3 augments again
    assert not torch.equal(layer.U, U)


@pytest.mark.parametrize("name,rule,hp", [
    ("sgd", sgd, dict(lr=0.1, momentum=0.9, weight_decay=0.01)),
    ("adam", adam, dict(lr=0.01, betas=(0.9, 0.99), eps=1e-8, weight_decay=0.01)),
])
def test_dense_parameters_follow_the_torch_rule(name, rule, hp):
    """Non-low-rank parameters get exactly torch.optim.SGD / Adam updates."""
    torch.manual_seed(1)
    model = nn.Sequential(LowRankLinear(6, 5, 2, dtype=F64), nn.LayerNorm(5, dtype=F64),
                          nn.Linear(5, 2).double())
    ref = nn.Sequential(nn.LayerNorm(5, dtype=F64), nn.Linear(5, 2).double())
    ref.load_state_dict(nn.Sequential(model[1], model[2]).state_dict())
    kw = {k: v for k, v in hp.items() if k != "lr"}
    opt = DLRT(model, hp["lr"], tau=0.1, optimizer=name, adaptive=False, **kw)
    torch_opt = (torch.optim.SGD if name == "sgd" else torch.optim.Adam)(ref.parameters(), **hp)
    step_beside_torch(opt, torch_opt, model, ref)
    for a, b in zip(nn.Sequential(model[1], model[2]).parameters(), ref.parameters(), strict=True):
        torch.testing.assert_close(a, b)


def test_state_transport_exact_for_rotations():
    """Moments accumulated in old coordinates and transported equal moments accumulated from
    rotated gradients: first moments for any rotation, Adam's second moments for a signed
    permutation."""
    g = [torch.randn(6, 4, dtype=F64) for _ in range(5)]
    R = torch.linalg.qr(torch.randn(4, 4, dtype=F64))[0]
    perm = torch.eye(4, dtype=F64)[[2, 0, 3, 1]] * torch.tensor([1.0, -1.0, -1.0, 1.0], dtype=F64)
    hp_sgd = dict(lr=0.1, momentum=0.9, weight_decay=0.0)
    hp_adam = dict(lr=0.1, betas=(0.9, 0.99), eps=1e-8, weight_decay=0.0)
    for rule, hp, Q in [(sgd, hp_sgd, R), (adam, hp_adam, perm)]:
        st_old, st_new = {}, {}
        p = torch.zeros(6, 4, dtype=F64)
        for gi in g[:3]:
            _, st_old = rule(gi, p, st_old, hp)
            _, st_new = rule(gi @ Q, p, st_new, hp)
        moved = transport(st_old, None, Q)
        d1, _ = rule(g[3] @ Q, p, moved, hp)
        d2, _ = rule(g[3] @ Q, p, st_new, hp)
        torch.testing.assert_close(d1, d2)
        if rule is adam:
            assert moved["step"] == 3  # the step count is kept


def test_momentum_follows_basis_rotation_in_optimizer():
    """Two models with the same weight but rotated factors take identical steps."""
    X, Y, _ = rank3_problem()
    a = LowRankLinear(20, 30, 5, bias=False, dtype=F64)
    b = LowRankLinear(20, 30, 5, bias=False, dtype=F64)
    Q, R = (torch.linalg.qr(torch.randn(5, 5, dtype=F64))[0] for _ in range(2))
    b.set_factors(a.U @ Q, Q.T @ a.S @ R, a.V @ R)
    oa, ob = (DLRT(m, 0.05, tau=0.0, momentum=0.9, adaptive=False) for m in (a, b))
    for _ in range(6):
        oa.step(mse_closure(oa, a, X, Y))
        ob.step(mse_closure(ob, b, X, Y))
    torch.testing.assert_close(a.weight_matrix(), b.weight_matrix(), atol=1e-10, rtol=0)


@pytest.mark.parametrize("mode", ["raise", "skip"])
@pytest.mark.parametrize("single_pass", BOTH)
def test_nonfinite_loss_never_writes_nan(mode, single_pass):
    model, (X, Y) = _net(), _data()
    opt = SDLRT(model, 0.1, tau=0.2, on_nonfinite=mode, single_pass=single_pass)
    opt.step(mse_closure(opt, model, X, Y))
    before = {k: v.clone() for k, v in model.state_dict().items()}
    bad = Y.clone()
    bad[0, 0] = float("nan")
    if mode == "raise":
        with pytest.raises(FloatingPointError, match="non-finite"):
            opt.step(mse_closure(opt, model, X, bad))
    else:
        with pytest.warns(RuntimeWarning, match="skipped"):
            opt.step(mse_closure(opt, model, X, bad))
    after = model.state_dict()
    assert before.keys() == after.keys()
    for k in before:
        assert torch.equal(before[k], after[k]), k
    opt.step(mse_closure(opt, model, X, Y))  # training continues
    assert all(torch.isfinite(v).all() for v in model.state_dict().values())


def test_state_dict_round_trip_after_rank_changes(tmp_path):
    torch.manual_seed(2)
    model, (X, Y) = _net(), _data()
    opt = SDLRT(model, 0.05, tau=0.4, optimizer="adam")
    for _ in range(4):
        opt.step(mse_closure(opt, model, X, Y))
    ranks = opt.ranks()
    assert ranks != {"0": 3, "3": 4, "5": 2}  # ranks really changed
    torch.save({"model": model.state_dict(), "opt": opt.state_dict()}, tmp_path / "ck.pt")
    fresh = _net()
    ck = torch.load(tmp_path / "ck.pt", weights_only=True)
    fresh.load_state_dict(ck["model"])
    opt2 = SDLRT(fresh, 0.05, tau=0.4, optimizer="adam")
    opt2.load_state_dict(ck["opt"])
    assert opt2.ranks() == ranks and opt2.taus() == opt.taus()
    torch.testing.assert_close(fresh(X), model(X), rtol=0, atol=0)
    opt.step(mse_closure(opt, model, X, Y))
    opt2.step(mse_closure(opt2, fresh, X, Y))
    for (k, a), b in zip(model.state_dict().items(), fresh.state_dict().values(), strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0, msg=k)


def test_half_precision_model_trains_with_float32_integrator():
    model = _net(torch.bfloat16)
    X, Y = _data(torch.bfloat16)
    opt = SDLRT(model, 0.05, tau=0.2)
    for _ in range(3):
        loss = opt.step(mse_closure(opt, model, X, Y))
    assert torch.isfinite(loss) and model[0].U.dtype == torch.bfloat16


def test_step_without_closure_uses_last_backward():
    X, Y, _ = rank3_problem()
    a = LowRankLinear(20, 30, 5, dtype=F64)
    b = LowRankLinear(20, 30, 5, dtype=F64)
    b.load_state_dict(a.state_dict())
    oa, ob = DLRT(a, 0.1, tau=0.1), DLRT(b, 0.1, tau=0.1)
    for _ in range(3):
        oa.step(mse_closure(oa, a, X, Y))
        ob.zero_grad()
        ((b(X) - Y) ** 2).sum(-1).mean().backward()
        ob.step()
    torch.testing.assert_close(a.weight_matrix(), b.weight_matrix(), rtol=0, atol=0)
    with pytest.raises(ValueError, match="closure"):
        DLRT(a, 0.1, tau=0.1, single_pass=False).step()


def test_lr_scheduler_drives_the_step():
    X, Y, _ = rank3_problem()
    layer = LowRankLinear(20, 30, 5, dtype=F64)
    opt = DLRT(layer, 0.1, tau=0.1, adaptive=False)
    sched = torch.optim.lr_scheduler.StepLR(opt, 1, gamma=0.0)
    opt.step(mse_closure(opt, layer, X, Y))
    sched.step()
    W = layer.weight_matrix().clone()
    opt.step(mse_closure(opt, layer, X, Y))  # lr is 0 now: Galerkin exactness
    torch.testing.assert_close(layer.weight_matrix(), W, atol=1e-12, rtol=0)


def test_bad_optimizer_arguments():
    layer = LowRankLinear(4, 4, 2)
    with pytest.raises(ValueError, match="`tau` must be in"):
        DLRT(layer, 0.1, tau=1.2)
    with pytest.raises(ValueError, match="`optimizer` must be one of"):
        DLRT(layer, 0.1, tau=0.1, optimizer="lion")
    with pytest.raises(ValueError, match="`omega`"):
        SDLRT(layer, 0.1, tau=0.1, omega=1.0)
    with pytest.raises(ValueError, match="`update_every`"):
        DLRT(layer, 0.1, tau=0.1, update_every=0)


@pytest.mark.parametrize("cls", [DLRT, SDLRT])
def test_batched_layers_step_like_separate_optimizers(cls):
    """Layers of one shape are integrated in batches: three same-shape layers in one
    optimizer take the steps each would take alone (float64, adaptive ranks)."""
    torch.manual_seed(0)
    X = torch.randn(3, 20, 16, dtype=F64)
    Y = torch.stack([X[i] @ torch.randn(16, k, dtype=F64) @ torch.randn(k, 16, dtype=F64)  # targets of
                     for i, k in enumerate((1, 6, 12))])                                   # ranks 1, 6, 12
    layers = [LowRankLinear(16, 16, 4, dtype=F64) for _ in range(3)]
    alone = [LowRankLinear(16, 16, 4, dtype=F64) for _ in range(3)]
    for a, b in zip(layers, alone, strict=True):
        b.load_state_dict(a.state_dict())

    class Three(nn.Module):
        def __init__(self, ls):
            super().__init__()
            self.ls = nn.ModuleList(ls)

        def forward(self, x):
            return torch.stack([m(x[i]) for i, m in enumerate(self.ls)])

    together = Three(layers)
    opt = cls(together, 0.05, tau=0.1)
    opts = [cls(m, 0.05, tau=0.1) for m in alone]
    def closure():  # the sum of the three layers' own losses
        opt.zero_grad()
        loss = ((together(X) - Y) ** 2).sum(-1).mean(-1).sum()
        loss.backward()
        return loss.detach()

    for _ in range(8):
        opt.step(closure)
        for i, (m, o) in enumerate(zip(alone, opts, strict=True)):
            o.step(mse_closure(o, m, X[i], Y[i]))
    for a, b in zip(layers, alone, strict=True):
        assert a.rank == b.rank
        torch.testing.assert_close(a.weight_matrix(), b.weight_matrix())
    assert len({m.rank for m in layers}) > 1 or layers[0].rank != 4  # ranks moved: batches regroup
