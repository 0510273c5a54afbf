"""The optimizer's settings object (issue 25): one place that validates and holds every choice,
round-trips through state_dict, and is what the presets' keyword arguments build."""

from __future__ import annotations

import io
import warnings

import pytest
import torch
from torch import nn

import rankwise
from helpers import xent_closure
from rankwise.optim import Settings


def _model(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(12, 16), nn.Tanh(), nn.Linear(16, 5)).double()
    return rankwise.to_low_rank(model, rank=4)


def _closure(opt, model, seed: int = 1):
    g = torch.Generator().manual_seed(seed)
    x, y = torch.randn(32, 12, generator=g, dtype=torch.float64), torch.randint(0, 5, (32,), generator=g)
    return xent_closure(opt, model, x, y)


SETTINGS = [
    Settings(rankwise.Tolerance(0.1)),
    Settings(rankwise.Tolerance(0.2), rankwise.SeedFeedback(0.7, 0.01), True, rankwise.SGD(0.9, 1e-4),
             single_pass=False, min_rank=1, max_rank=6, update_every=2, on_nonfinite="skip"),
    Settings(rankwise.Tolerance(0.2), rankwise.TwoSidedFeedback(tau_max=0.4),
             rule=rankwise.Adam((0.8, 0.99), 1e-6)),
    Settings(rankwise.Budget(0.5, ramp_steps=3, allocation="sensitivity", floor=0.5, freeze_after=4),
             buffer=True, rule=rankwise.Adam(weight_decay=0.01)),
    Settings(rankwise.Budget(params=300, ramp_steps=0, count_buffer=True), buffer=True, adaptive=True,
             data_parallel="sharded", check_every=0),
]


@pytest.mark.parametrize("settings", SETTINGS, ids=range(len(SETTINGS)))
def test_settings_round_trip_through_the_state_dict(settings):
    model = _model()
    opt = rankwise.AugmentedBUG(model, 0.01, settings)
    assert opt.settings is settings
    for _ in range(2):
        opt.step(_closure(opt, model))
    saved = opt.state_dict()["param_groups"][0]["settings"]
    assert Settings.from_dict(saved) == settings
    # plain data only, so torch.load(weights_only=True) reads it back
    buf = io.BytesIO()
    torch.save(opt.state_dict(), buf)
    buf.seek(0)
    loaded = torch.load(buf, weights_only=True)
    assert Settings.from_dict(loaded["param_groups"][0]["settings"]) == settings


def test_keyword_settings_and_a_settings_object_train_identically():
    a, b = _model(), _model()
    kw = rankwise.AugmentedBUG(a, 0.05, truncation=rankwise.Tolerance(0.1), buffer=True,
                               feedback=rankwise.SeedFeedback(), rule=rankwise.SGD(momentum=0.9))
    obj = rankwise.AugmentedBUG(b, 0.05, Settings(rankwise.Tolerance(0.1), rankwise.SeedFeedback(), True,
                                                  rankwise.SGD(momentum=0.9)))
    preset = rankwise.SDLRT(_model(), 0.05, tau=0.1, momentum=0.9)
    assert kw.settings == obj.settings == preset.settings
    for step in range(4):
        kw.step(_closure(kw, a, step))
        obj.step(_closure(obj, b, step))
    for p, q in zip(a.state_dict().values(), b.state_dict().values(), strict=True):
        assert torch.equal(p, q)


def test_the_presets_keyword_arguments_build_the_rule():
    m = _model()
    assert rankwise.DLRT(m, 0.1, tau=0.1).settings.rule == rankwise.SGD()
    opt = rankwise.DLRT(m, 0.1, tau=0.1, momentum=0.9, weight_decay=0.1)
    assert opt.settings.rule == rankwise.SGD(0.9, 0.1)
    opt = rankwise.SDLRT(m, 0.1, tau=0.1, optimizer="adam", betas=(0.8, 0.9), eps=1e-6)
    assert opt.settings.rule == rankwise.Adam((0.8, 0.9), 1e-6)
    assert opt.settings.buffer and opt.settings.feedback == rankwise.SeedFeedback()
    # the param group holds the rule's live hyperparameters (schedulers change them there)
    group = opt.param_groups[0]
    assert (group["betas"], group["eps"], group["weight_decay"]) == ((0.8, 0.9), 1e-6, 0.0)
    assert rankwise.SDLRT(m, 0.1, tau=0.1, rule=rankwise.Adam()).settings.rule == rankwise.Adam()
    with pytest.raises(ValueError, match=r"`momentum` is SGD's .* the rule is 'adam': it would be unused"):
        rankwise.SDLRT(m, 0.1, tau=0.1, optimizer="adam", momentum=0.9)  # (it was silently dropped)
    with pytest.raises(ValueError, match="`betas` and `eps` are Adam's"):
        rankwise.DLRT(m, 0.1, tau=0.1, betas=(0.9, 0.99), eps=1e-6)  # (the rule is SGD: they stayed unused)


def test_the_sgd_rule_is_spelled_as_torch_spells_it_and_its_earlier_name_still_works():
    import rankwise.optim

    assert rankwise.SGD.__name__ == "SGD" and rankwise.Sgd is rankwise.SGD is rankwise.optim.Sgd
    assert "Sgd" not in dir(rankwise) and "Sgd" not in rankwise.optim.__all__
    with pytest.raises(AttributeError, match="no attribute 'Sdg'"):
        rankwise.optim.Sdg  # noqa: B018


@pytest.mark.parametrize("make, err, match", [
    (lambda m: rankwise.AugmentedBUG(m, 0.1, truncation=rankwise.Tolerance(0.1), rule=rankwise.Adam(),
                                     momentum=0.9), TypeError, "not both"),
    (lambda m: rankwise.AugmentedBUG(m, 0.1, truncation=rankwise.Tolerance(0.1), tau=0.1),
     TypeError, "'tau'"),
    (lambda m: rankwise.AugmentedBUG(m, 0.1, rule=rankwise.Adam()), TypeError, "missing `truncation`"),
    (lambda m: rankwise.AugmentedBUG(m, 0.1, Settings(rankwise.Tolerance(0.1)), buffer=True),
     TypeError, "not both"),
    (lambda m: rankwise.AugmentedBUG(m, 0.1, truncation=rankwise.Tolerance(0.1), rule=torch.optim.Adam),
     TypeError, "rankwise.SGD"),
    (lambda m: rankwise.DLRT(m, 0.1, tau=0.1, buffer=True), TypeError,
     "unexpected keyword argument 'buffer'"),
    (lambda m: rankwise.SDLRT(m, 0.1, tau=0.1, truncation=rankwise.Tolerance(0.1)), TypeError, "truncation"),
    (lambda m: rankwise.SGD(momentum=1.0), ValueError, "momentum"),
    (lambda m: rankwise.SGD(weight_decay=-1), ValueError, "weight_decay"),
    (lambda m: rankwise.Adam(betas=(0.9,)), TypeError, "betas"),
    (lambda m: rankwise.Adam(eps=0), ValueError, "eps"),
    (lambda m: Settings(rankwise.Tolerance(0.1), update_every=0), ValueError, "update_every"),
    (lambda m: Settings(rankwise.Tolerance(0.1), buffer=1), TypeError, "buffer"),
    (lambda m: Settings(rankwise.Tolerance(0.1), min_rank=3, max_rank=2), ValueError, "min_rank <= max_rank"),
    (lambda m: Settings(rankwise.Budget(0.5), feedback=rankwise.SeedFeedback()), ValueError,
     "Budget has none"),
    (lambda m: Settings(rankwise.Tolerance(0.1), data_parallel="zero"), ValueError, "data_parallel"),
    (lambda m: Settings(rankwise.Tolerance(0.1), check_every=-1), ValueError, "check_every"),
])
def test_bad_settings_are_refused_naming_the_argument(make, err, match):
    with pytest.raises(err, match=match):
        make(_model())


def test_a_state_saved_before_the_settings_objects_still_loads():
    """Before issue 25 the param group held every rule's hyperparameters and the policies as
    text (no ``settings``); such a state loads, silently under the same policies."""
    model = _model()
    opt = rankwise.SDLRT(model, 0.05, tau=0.1, momentum=0.9)
    for step in range(3):
        opt.step(_closure(opt, model, step))
    old = opt.state_dict()
    group = old["param_groups"][0]
    del group["settings"]
    group.update(betas=(0.9, 0.999), eps=1e-8,
                 policies="Tolerance(tau=0.1), feedback=SeedFeedback(omega=0.8, tau_min=0.0), buffer=True")
    fresh_model = _model()
    fresh_model.load_state_dict(model.state_dict())
    fresh = rankwise.SDLRT(fresh_model, 0.05, tau=0.1, momentum=0.9)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        fresh.load_state_dict(old)
    assert fresh.param_groups[0]["settings"] == fresh.settings.to_dict()
    assert "policies" not in fresh.param_groups[0]
    assert fresh.param_groups[0]["global_step"] == 3
    other = rankwise.DLRT(_model(), 0.05, tau=0.1, momentum=0.9)
    with pytest.warns(UserWarning, match="other policies"):
        other.load_state_dict(old)


def test_frozen_parameters_are_held_and_left_alone():
    """As torch.optim.Adam(model.parameters()): a frozen parameter is held, and a step leaves it
    as it is (it has no gradient)."""
    model = _model()
    model[0].bias.requires_grad_(False)
    opt = rankwise.DLRT(model, 0.1, tau=0.1)
    held = {id(p) for g in opt.param_groups for p in g["params"]}
    assert id(model[0].bias) in held and id(model[0].U) in held and id(model[0].V) in held
    before = model[0].bias.detach().clone()
    model(torch.randn(4, 12, dtype=torch.float64)).square().mean().backward()
    opt.step()
    assert torch.equal(model[0].bias, before) and not model[0].bias.requires_grad
