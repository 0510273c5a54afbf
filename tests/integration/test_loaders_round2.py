"""Loaders and state that trust too much (issue 56, round 2): every read of a user-given file is
bounded, regular-file-only and inside its folder; a saved optimizer state is checked before it
is loaded; the write-protected weight view refuses in-place functionals; the data-parallel
replica check sees sign flips and names the rank that differs."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from rankwise import SDLRT
from rankwise.lowrank import LowRankLinear

pytestmark = pytest.mark.usefixtures("one_thread")


# --------------------------------------------------------------------------- optimizer state
def _trained():
    torch.manual_seed(0)
    model = nn.Sequential(LowRankLinear(8, 6, 2), nn.ReLU(), nn.Linear(6, 3))
    opt = SDLRT(model, 0.05, tau=0.3, momentum=0.9, optimizer="adam")
    X, Y = torch.randn(10, 8), torch.randn(10, 3)

    def closure():
        opt.zero_grad()
        loss = ((model(X) - Y) ** 2).mean()
        loss.backward()
        return loss

    opt.step(closure)
    return model, opt, closure


def _spoiled(sd: dict, index: int, key: str, value) -> dict:
    sd = copy.deepcopy(sd)
    sd["state"][index][key] = value
    return sd


@pytest.mark.parametrize(("index", "key", "value", "match"), [
    (0, "m", lambda t: t[:, 0].clone(), r"layer '0' has K moment 'm' of shape \(6,\) where its parameter is \(6, 2\)"),
    (2, "v", lambda t: t[None].clone(), r"layer '0' has L moment 'v' of shape \(1, 8, 2\) where its parameter"),
    (1, "tau", lambda t: float("nan"), r"layer '0' has 'tau' = nan, not a number in \[0, 1\)"),
    (1, "tau", lambda t: 1.5, r"layer '0' has 'tau' = 1.5"),
    (1, "r_init", lambda t: -1, r"layer '0' has 'r_init' = -1, not a whole number"),
    (0, "step", lambda t: float("nan"), r"layer '0' has 'step' = nan"),
    (4, "m", lambda t: t.T.clone(), r"parameter 4 has moment 'm' of shape \(6, 3\) where its parameter is \(3, 6\)"),
    (0, "v", lambda t: "zeros", r"K moment 'v' a str, not a floating-point tensor"),
])
def test_optimizer_state_that_no_optimizer_wrote_is_refused_naming_layer_and_key(index, key, value, match):
    model, opt, closure = _trained()
    sd = opt.state_dict()
    bad = _spoiled(sd, index, key, value(sd["state"][index].get(key)))
    fresh = SDLRT(model, 0.05, tau=0.3, momentum=0.9, optimizer="adam")
    with pytest.raises(ValueError, match=match):
        fresh.load_state_dict(bad)
    fresh.load_state_dict(sd)  # the state as saved still loads, and trains on
    fresh.step(closure)
