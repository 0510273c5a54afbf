"""rankwise.methods: one registry of method names, read by every command, so that a name builds
the same integrator settings in `train`, `sweep`, `lm`, `peft` and `ckpt demo`."""

import subprocess
import sys

import pytest
import torch
from torch import nn

import rankwise
from rankwise import methods
from rankwise.methods import COMMANDS, METHOD_FIELDS, REGISTRY


def test_the_registry_is_importable_without_torch():
    code = ("import sys; import rankwise.methods, rankwise.train_config, rankwise.experiments._sweep_spec, "
            "rankwise.experiments.lm._lm_spec, rankwise.experiments.peft._peft_spec, "
            "rankwise.experiments.ddp_resilience; print('torch' in sys.modules)")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and r.stdout.strip() == "False", r.stderr


def test_every_commands_methods_come_from_the_registry():
    from rankwise.cli._app import Method
    from rankwise.experiments import _sweep_spec, ddp_resilience
    from rankwise.experiments.lm import _lm_spec
    from rankwise.experiments.peft import _peft_spec
    from rankwise.train_config import METHODS as TRAIN

    listed = {"train": TRAIN, "sweep": _sweep_spec.METHODS, "lm": _lm_spec.METHODS,
              "peft": _peft_spec.METHODS, "ckpt": ddp_resilience.METHODS}
    assert listed == dict(COMMANDS)
    assert tuple(m.value for m in Method) == COMMANDS["train"]
    for names in COMMANDS.values():
        assert set(names) <= set(REGISTRY)
    for defaults in (_sweep_spec.DEFAULT_METHODS, _sweep_spec.TARGET_METHODS, _sweep_spec.TARGET_DEFAULT):
        assert set(defaults) <= set(COMMANDS["sweep"])
    assert not set(methods.RENAMED) & set(REGISTRY)


# ----------------------------------------------------------------- each command's optimizer
def _mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 4))


class _Attention(nn.Module):
    """What rankwise peft adapts (query, key, value) and trains (classifier), in small."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.query, self.key, self.value = (nn.Linear(32, 32) for _ in range(3))
        self.classifier = nn.Linear(32, 5)


def _train(name: str, **level):
    from rankwise.experiments.train_run import _build
    from rankwise.train_config import TrainConfig

    return _build(TrainConfig(method=name, model="mlp", rank=8, **level), 100)[1]


def _sweep(name: str, **level):
    from rankwise.experiments._sweep_spec import RunSpec
    from rankwise.experiments.sweep import _integrator

    spec = RunSpec(task="mlp-digits", method=name, **level)
    return _integrator(rankwise.to_low_rank(_mlp(), rank=8), spec, 100)


def _lm(name: str):
    from rankwise.experiments.lm.lm_compare import LmRunSpec, build

    return build(LmRunSpec(name, 0.5, context=16, width=32, depth=1, heads=2, steps=4))[1]


def _peft(name: str):
    from rankwise.experiments.peft._peft_spec import PeftRunSpec
    from rankwise.experiments.peft.peft_compare import _adapters

    return _adapters(_Attention(), PeftRunSpec(method=name))[1]


def _ckpt(name: str):
    from rankwise.experiments.ddp_resilience import lowrank_optimizer

    return lowrank_optimizer(name, rankwise.to_low_rank(_mlp(), rank=8))


def _meaning(opt) -> dict:
    """What the method decides of an optimizer's settings (the rest is the command's)."""
    s = opt.settings
    fb = s.feedback
    return {**{f: getattr(s, f) for f in METHOD_FIELDS},
            "feedback": None if fb is None else (type(fb).__name__, fb.omega, fb.tau_min)}


@pytest.mark.parametrize("name", ["dlrt", "sdlrt"])
def test_a_name_builds_the_same_settings_in_every_command(name):
    """At a tolerance (train, sweep, ckpt demo: the τ feedback applies) and at a budget (train
    and sweep with a target, lm, peft: it does not), each command's optimizer for `name` has
    the settings the library's preset has."""
    preset = (rankwise.SDLRT if name == "sdlrt" else rankwise.DLRT)(rankwise.to_low_rank(_mlp(), rank=8), 0.1,
                                                                      tau=0.2)
    at_tau = [_train(name), _sweep(name, tau=0.2), _ckpt(name)]
    for opt in at_tau:
        assert _meaning(opt) == _meaning(preset), opt
    at_budget = [_train(name, target=0.8), _sweep(name, target=0.9), _lm(name), _peft(name)]
    for opt in at_budget:
        assert opt.settings.budgeted and _meaning(opt) == {**_meaning(preset), "feedback": None}, opt
    if name == "sdlrt":  # the paper's feedback and the buffer
        assert _meaning(preset)["feedback"] == ("SeedFeedback", 0.8, 0.0) and _meaning(preset)["buffer"]


def test_the_two_sided_feedback_has_its_own_name():
    two = _sweep("sdlrt-two-sided", tau=0.2)
    assert _meaning(two)["feedback"][0] == "TwoSidedFeedback" and two.settings.buffer
    assert _meaning(_sweep("sdlrt", tau=0.2))["feedback"][0] == "SeedFeedback"


def test_peft_builds_what_the_adapter_api_builds():
    """The peft command's budgeted DLRT/SDLRT are rankwise.peft.adapter_optimizer's."""
    from rankwise.peft import AdapterConfig, adapter_optimizer, get_adapter_model

    for name in ("dlrt", "sdlrt"):
        config = AdapterConfig(["query", "key", "value"], r=10, method=name, budget="lora:10",
                               modules_to_save=["classifier"])
        model = get_adapter_model(_Attention(), config)
        assert adapter_optimizer(model, 1e-3, optimizer="adam").settings == _peft(name).settings
    capped = _peft("sdlrt-cap2r")
    assert capped.settings.truncation == rankwise.Tolerance(0.02)
    assert _meaning(capped) == _meaning(_ckpt("sdlrt"))


# ----------------------------------------------------------------- variants are entries
def test_variants_are_entries_with_their_settings():
    tol, budget = rankwise.Tolerance(0.1), rankwise.Budget(params=1000, ramp_steps=0)
    assert methods.settings("dlrt-ue5", tol).update_every == 5
    assert methods.settings("dlrt-ue20", budget).update_every == 20
    assert methods.settings("dlrt-core0.3", budget).core_lr_ratio == 0.3
    assert methods.settings("dlrt-reset", budget).moments == "reset"
    assert methods.settings("dlrt-reset-v", budget).moments == "reset_v"
    ue = methods.settings("dlrt-reset-ue20", budget)
    assert (ue.moments, ue.update_every) == ("reset", 20)
    muon = methods.settings("dlrt-muon-reset", budget, rule=rankwise.Adam(eps=1e-6))
    assert muon.rule == rankwise.Muon(eps=1e-6) and muon.moments == "reset"
    assert methods.settings("dlrt-uniform", budget).truncation.allocation == "uniform"
    fixed = methods.settings("dlrt-fixedrank", budget)
    assert not fixed.adaptive and fixed.truncation == rankwise.Tolerance(0.0)
    assert not methods.settings("dlrt-2pass", tol).single_pass
    assert methods.settings("sdlrt-buffer", tol).feedback is None
    feedback = methods.settings("sdlrt-feedback", tol)
    assert not feedback.buffer and isinstance(feedback.feedback, rankwise.SeedFeedback)
    # what a method decides cannot be changed by its command; what it leaves open can
    with pytest.raises(TypeError, match="method dlrt decides `buffer`"):
        methods.settings("dlrt", tol, buffer=True)
    with pytest.raises(ValueError, match="dlrt-ue5 sets update_every=5"):
        methods.settings("dlrt-ue5", tol, update_every=3)
    assert methods.settings("dlrt", tol, update_every=3, min_rank=1).update_every == 3
    with pytest.raises(ValueError, match="fixed is a baseline"):
        methods.settings("fixed", tol)
    with pytest.raises(ValueError, match=r"sdlrt-seed is called sdlrt"):
        methods.get("sdlrt-seed")


def test_every_integrator_of_every_command_builds():
    tol, budget = rankwise.Tolerance(0.1), rankwise.Budget(params=1000, ramp_steps=0)
    for name in {m for names in COMMANDS.values() for m in names if not REGISTRY[m].baseline}:
        for truncation in (tol, budget):
            s = methods.settings(name, truncation)
            assert {k: getattr(s, k) for k in REGISTRY[name].settings} == dict(REGISTRY[name].settings)
            assert s.buffer == REGISTRY[name].buffer


def test_a_renamed_method_is_named_in_the_commands_error():
    from helpers import run_cli

    r = run_cli("sweep", "--methods", "dlrt,sdlrt-seed")
    assert r.exit_code == 2 and "sdlrt-seed is called sdlrt" in r.stderr, r.stderr
