"""The Muon rule for the factors (`rankwise.Muon`, `rankwise.optim.rules._rules.muon`) against
torch.optim.Muon on plain matrices, its batched Newton–Schulz against one matrix at a time, and
its AdamW on the dense parameters against torch.optim.AdamW. Its use inside DLRT/SDLRT is checked
step by step against the float64 reference in tests/optim/test_reference_step.py."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import rankwise
from rankwise.optim.rules._rules import muon, newton_schulz


def test_rule_matches_torch_muon():
    """Three steps of the rule on one matrix equal torch.optim.Muon's (match_rms_adamw, decoupled
    weight decay, Nesterov) up to torch's bfloat16 Newton–Schulz."""
    torch.manual_seed(0)
    p = torch.randn(6, 9)
    q = nn.Parameter(p.clone())
    ref = torch.optim.Muon([q], lr=0.02, weight_decay=0.1, adjust_lr_fn="match_rms_adamw")
    hp = {"lr": 0.02, "momentum": 0.95, "nesterov": True, "ns_steps": 5, "weight_decay": 0.1}
    state: dict = {}
    for _ in range(3):
        g = torch.randn(6, 9)
        q.grad = g.clone()
        before = q.detach().clone()
        ref.step()
        delta, state = muon(g, p, state, hp)
        p = p + delta
        want = q.detach() - before
        assert (delta - want).norm() < 2e-2 * want.norm()  # bfloat16 in torch's iteration
        torch.testing.assert_close(state["m"], ref.state[q]["momentum_buffer"])


def test_newton_schulz_batched_and_padded():
    """A batch gives each matrix's own result; zero-padded columns stay zero and do not change
    the rest; the singular values land in Muon's band around 1."""
    torch.manual_seed(1)
    X = torch.randn(3, 12, 5, dtype=torch.float64)
    Y = newton_schulz(X)
    for i in range(3):
        torch.testing.assert_close(Y[i], newton_schulz(X[i]))
    s = torch.linalg.svdvals(Y)
    assert bool(((s > 0.6) & (s < 1.25)).all()), s
    padded = torch.cat([X, torch.zeros(3, 12, 2, dtype=X.dtype)], -1)
    Z = newton_schulz(padded)
    torch.testing.assert_close(Z[..., :5], Y)
    assert bool((Z[..., 5:] == 0).all())


def test_dense_parameters_take_adamw():
    """Under DLRT(rule=Muon) a parameter outside the low-rank layers moves as torch.optim.AdamW
    moves it."""
    torch.manual_seed(2)
    model = nn.Sequential(rankwise.LowRankLinear(8, 8, 2), nn.Linear(8, 3))
    twin = nn.Linear(8, 3)
    twin.load_state_dict(model[1].state_dict())
    opt = rankwise.DLRT(model, 0.01, tau=0.1, rule=rankwise.Muon(weight_decay=0.05))
    ref = torch.optim.AdamW(twin.parameters(), lr=0.01, weight_decay=0.05)
    x = torch.randn(16, 8)
    for _ in range(2):
        opt.zero_grad()
        model(x).square().mean().backward()
        h = model[0](x).detach()
        ref.zero_grad()
        twin(h).square().mean().backward()
        opt.step()
        ref.step()
        torch.testing.assert_close(model[1].weight, twin.weight)


def test_settings_round_trip_and_refusals():
    rule = rankwise.Muon(momentum=0.9, ns_steps=3)
    opt = rankwise.DLRT(nn.Sequential(rankwise.LowRankLinear(4, 4, 2)), 0.01, tau=0.1, rule=rule)
    assert opt.settings.rule == rule
    assert rankwise.Settings.from_dict(opt.settings.to_dict()).rule == rule
    with pytest.raises(ValueError, match="ns_steps"):
        rankwise.Muon(ns_steps=0)
    with pytest.raises(ValueError, match="momentum"):
        rankwise.Muon(momentum=1.0)


def test_moments_auto_resets_under_muon_and_rotates_otherwise():
    """moments="auto" (the default) is issue 48's measured choice per rule: Muon's momentum
    restarts at every truncation (none is left in the K, L, S states after an augmenting step),
    Adam's and SGD's are carried into the new bases; an explicit value wins."""
    S = rankwise.Settings
    tol = rankwise.Tolerance(0.1)
    assert S(truncation=tol).moments == "auto"
    assert S(truncation=tol, rule=rankwise.Muon()).moments_used == "reset"
    assert S(truncation=tol, rule=rankwise.Adam()).moments_used == "rotate"
    assert S(truncation=tol, rule=rankwise.SGD(momentum=0.9)).moments_used == "rotate"
    assert S(truncation=tol, rule=rankwise.Muon(), moments="rotate").moments_used == "rotate"
    torch.manual_seed(3)
    for rule, kept in ((rankwise.Muon(), False), (rankwise.Adam(), True)):
        model = nn.Sequential(rankwise.LowRankLinear(8, 8, 2))
        opt = rankwise.DLRT(model, 0.01, tau=0.1, rule=rule)
        model(torch.randn(4, 8)).square().mean().backward()
        opt.step()
        assert ("m" in opt.state[model[0].U]) == kept
