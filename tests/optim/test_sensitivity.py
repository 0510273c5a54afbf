"""Data-aware rank allocation: the sensitivity score against autograd, its smoothing, and the
budget's new options (a parameter count, floors, an end phase at frozen ranks)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from torch import nn

import rankwise
from rankwise.nn._budget import allocate_ranks, layer_cost
from rankwise.optim import _sensitivity as sens
from rankwise.optim._step import augment_group, tangent_blocks

F64 = torch.float64


def _problem(seed=0, m=7, n=5, r0=2):
    g = torch.Generator().manual_seed(seed)
    U0 = torch.linalg.qr(torch.randn(m, r0, generator=g, dtype=F64))[0]
    V0 = torch.linalg.qr(torch.randn(n, r0, generator=g, dtype=F64))[0]
    S0 = torch.randn(r0, r0, generator=g, dtype=F64)
    X, T = torch.randn(9, n, generator=g, dtype=F64), torch.randn(9, m, generator=g, dtype=F64)
    return U0, S0, V0, X, T, g


def _loss(W, X, T):
    return ((torch.tanh(X @ W.mT) - T) ** 2).sum()


def _augment(U0, V0, g):
    """Ū = [U0, E_U], V̄ = [V0, E_V] with two new directions each (the step's augmentation)."""
    dK, dL = (torch.randn(d, 2, generator=g, dtype=F64)[None] for d in (7, 5))
    U, V, *_ = augment_group(U0[None], V0[None], dK, dL, U0[None, :, :0], V0[None, :, :0])
    return SimpleNamespace(U=U[0], V=V[0])


def test_tangent_blocks_give_the_tangent_projection_of_autograds_gradient():
    U0, S0, V0, X, T, g = _problem()
    W = (U0 @ S0 @ V0.mT).requires_grad_()
    _loss(W, X, T).backward()
    G = W.grad
    G_K, G_L, G_S = G @ V0, G.mT @ U0, U0.mT @ G @ V0
    aug = _augment(U0, V0, g)
    full = aug.U.mT @ G @ aug.V  # Ūᵀ G V̄, from the dense gradient
    full[2:, 2:] = 0  # the block of two new directions, which the integrator does not know
    got = tangent_blocks(2, aug.U[None, :, 2:], aug.V[None, :, 2:], G_S[None], G_K[None], G_L[None])[0]
    torch.testing.assert_close(got, full, rtol=1e-12, atol=1e-12)


def test_importance_is_sigma_times_the_loss_derivative_by_sigma():
    """|σ_i ∂L/∂σ_i| with W(σ) = Ū P diag(σ) Qᵀ V̄ᵀ, differentiated by autograd."""
    U0, _, V0, X, T, g = _problem(1)
    aug = _augment(U0, V0, g)
    S_bar = torch.randn(aug.U.shape[1], aug.V.shape[1], generator=g, dtype=F64)
    P, s, Qh = torch.linalg.svd(S_bar, full_matrices=False)  # S̄ = P diag(s) Qᵀ
    Q = Qh.mT
    sigma = s.clone().requires_grad_()
    W = aug.U @ P @ torch.diag(sigma) @ Q.mT @ aug.V.mT
    _loss(W, X, T).backward()
    Wd = W.detach().requires_grad_()
    _loss(Wd, X, T).backward()
    G_bar = aug.U.mT @ Wd.grad @ aug.V
    torch.testing.assert_close(sens.importance(P, s, Q, G_bar), (s * sigma.grad).abs(),
                               rtol=1e-10, atol=1e-12)


def test_smoothing_by_hand():
    beta1, beta2 = 0.8, 0.6
    prev = sens.Smoothed(torch.tensor([3.0, 1.0], dtype=F64), torch.tensor([0.5, 0.2], dtype=F64))
    # new direction 0 is old direction 1, new direction 1 old direction 0, new direction 2 is new
    P = torch.tensor([[0.0, 1.0, 0.0], [1.0, 0.0, 0.0], [0.0, 0.0, 1.0]], dtype=F64)
    inst = torch.tensor([2.0, 4.0, 7.0], dtype=F64)
    got = sens.smooth(prev, P, P, inst, beta1=beta1, beta2=beta2)
    I_exp = torch.tensor([0.8 * 1.0 + 0.2 * 2.0, 0.8 * 3.0 + 0.2 * 4.0, 7.0], dtype=F64)
    U_exp = torch.tensor([0.6 * 0.2, 0.6 * 0.5, 0.0], dtype=F64) + 0.4 * (inst - I_exp).abs()
    torch.testing.assert_close(got.I, I_exp)
    torch.testing.assert_close(got.U, U_exp)
    torch.testing.assert_close(sens.scores(got), I_exp + U_exp)
    first = sens.smooth(None, P, P, inst, beta1=beta1, beta2=beta2)  # no history: the instant value
    torch.testing.assert_close(first.I, inst)
    assert not first.U.any()


def test_allocate_ranks_takes_given_scores_and_costs_the_buffer():
    shapes = {"a": (10, 10), "b": (10, 10)}
    spectra = {"a": torch.ones(6, dtype=F64), "b": torch.ones(6, dtype=F64)}
    scores = {"a": [5.0, 4.0, 3.0, 0.5, 0.4, 0.3], "b": [2.0, 1.0, 0.9, 0.8, 0.7, 0.6]}
    budget = layer_cost(10, 10, 3) + layer_cost(10, 10, 2)
    assert allocate_ranks(spectra, shapes, budget, rule="sensitivity", scores=scores) == {"a": 3, "b": 2}
    budget_buf = layer_cost(10, 10, 3, buffer=True) + layer_cost(10, 10, 2, buffer=True)
    ranks = allocate_ranks(spectra, shapes, budget_buf, rule="sensitivity", scores=scores, buffer=True)
    assert ranks == {"a": 3, "b": 2}
    assert layer_cost(10, 10, 3, buffer=True) == 3 * 20 + 9 + 3 * 20
    with pytest.raises(ValueError, match="scores"):
        allocate_ranks(spectra, shapes, budget, rule="sensitivity")
    assert allocate_ranks(spectra, shapes, 0, min_rank={"a": 2, "b": 1}) == {"a": 2, "b": 1}


class _TwoBranch(nn.Module):
    """Two layers of the same shape; the loss reads only the first (the second's gradient is 0)."""

    def __init__(self) -> None:
        super().__init__()
        self.used, self.unused = nn.Linear(16, 16), nn.Linear(16, 16)

    def forward(self, x):
        return self.used(x) + 0.0 * self.unused(x)


def _train(model, opt, steps=12, seed=0, check=None):
    g = torch.Generator().manual_seed(seed)
    X = torch.randn(64, 16, generator=g)
    Y = torch.tanh(X @ torch.randn(16, 16, generator=g))
    for _ in range(steps):
        opt.zero_grad()
        nn.functional.mse_loss(model(X), Y).backward()
        opt.step()
        if check is not None:
            check()


def test_sensitivity_budget_gives_rank_to_the_layer_the_loss_reads():
    torch.manual_seed(0)
    model = rankwise.to_low_rank(_TwoBranch(), rank=8)
    spectral = rankwise.to_low_rank(_TwoBranch(), rank=8)
    spectral.load_state_dict(model.state_dict())
    kw = dict(target=0.6, ramp_steps=6, optimizer="adam")
    opt = rankwise.DLRT(model, 1e-2, allocation="sensitivity", **kw)
    _train(model, opt)
    ranks = opt.ranks()
    assert ranks["used"] > ranks["unused"] == 2  # the unused layer drops to min_rank
    assert opt.budget()["stored_params"] <= opt.budget()["budget_params"]
    st = opt.state[model.used.S]["sensitivity"]
    assert st[0].shape == (ranks["used"],) and bool((st[0] >= 0).all())
    other = rankwise.DLRT(spectral, 1e-2, allocation="error-sqrt", **kw)
    _train(spectral, other)
    assert other.ranks()["unused"] > 2  # the spectral rule sees only the (random) weights


@pytest.mark.parametrize("sdlrt", [False, True])
def test_params_budget_holds_at_every_step_buffer_counted(sdlrt):
    torch.manual_seed(1)
    model = rankwise.to_low_rank(nn.Sequential(nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 16)), rank=3)
    budget = 2 * layer_cost(16, 16, 3, buffer=sdlrt)
    opt = rankwise.AugmentedBUG(model, 1e-2, truncation=rankwise.Budget(params=budget, ramp_steps=0,
                                                                         count_buffer=True),
                                buffer=sdlrt, optimizer="adam")
    held = []

    def check():
        n = sum(m.U.numel() + m.S.numel() + m.V.numel() + m.U_buf.numel() + m.V_buf.numel()
                for m in (model[0], model[2]))
        assert n <= budget
        held.append(opt.budget()["layer_params"])
        assert held[-1] <= budget

    _train(model, opt, steps=8, check=check)
    if sdlrt:
        assert model[0].U_buf.shape[1] > 0  # the buffer exists and is paid for
    assert max(held) >= budget - 2 * layer_cost(16, 16, 1, buffer=sdlrt)  # and the budget is used


def test_floor_and_freeze():
    torch.manual_seed(2)
    model = rankwise.to_low_rank(_TwoBranch(), rank=8)
    opt = rankwise.AugmentedBUG(model, 1e-2, optimizer="adam", truncation=rankwise.Budget(
        0.6, ramp_steps=4, allocation="sensitivity", floor=1.0, freeze_after=6))
    seen = []
    _train(model, opt, steps=12, check=lambda: seen.append(opt.ranks()))
    # floor 1.0: no layer below the uniform allocation's rank, so the unused layer keeps rank
    assert seen[-1]["unused"] >= seen[-1]["used"] - 1
    assert all(r == seen[5] for r in seen[6:])  # frozen from the 7th augmentation (index 6) on


@pytest.mark.parametrize("bad, match", [
    (dict(), "exactly one"), (dict(target=0.5, params=10), "exactly one"),
    (dict(params=0), "params"), (dict(params=10, floor=2.0), "floor"),
    (dict(target=0.5, ramp_steps=10, freeze_after=5), "freeze_after"),
    (dict(target=0.5, allocation="nope"), "sensitivity"), (dict(target=0.5, beta1=1.0), "beta1"),
])
def test_budget_checks_its_arguments(bad, match):
    with pytest.raises(ValueError, match=match):
        rankwise.Budget(**bad)


def test_params_budget_too_small_is_refused():
    model = rankwise.to_low_rank(nn.Sequential(nn.Linear(16, 16)), rank=3)
    with pytest.raises(ValueError, match="cannot hold"):
        rankwise.AugmentedBUG(model, 0.1, truncation=rankwise.Budget(params=10))


def test_default_budget_repr_is_unchanged():
    """Saved optimizer states record the policies' repr: the defaults must print as before."""
    assert repr(rankwise.Budget(0.9, 300)) == "Budget(target=0.9, ramp_steps=300, allocation='error-sqrt')"
