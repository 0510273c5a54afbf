"""API validation of DLRT / SDLRT and to_low_rank: bad arguments and misused closures fail
loudly, naming the argument, and leave the weights untouched."""

from __future__ import annotations

import copy
import math
import re

import pytest
import torch
from torch import nn

import rankwise
from helpers import F64, mse_closure, rank3_problem, xent_closure
from rankwise import DLRT, SDLRT, LowRankConv2d, LowRankLinear

OPTIMIZERS = [DLRT, SDLRT]


def _snapshot(model: nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in model.state_dict().items()}


def _assert_same_state(a, b) -> None:
    """Two optimizer state_dicts (nested dicts, lists, tensors, numbers) are equal exactly."""
    if isinstance(a, dict):
        assert a.keys() == b.keys()
        for k in a:
            _assert_same_state(a[k], b[k])
    elif isinstance(a, list | tuple):
        assert len(a) == len(b)
        for x, y in zip(a, b, strict=True):
            _assert_same_state(x, y)
    elif torch.is_tensor(a):
        assert torch.equal(a, b)
    else:
        assert a == b


def _assert_unchanged(model: nn.Module, before: dict[str, torch.Tensor]) -> None:
    after = model.state_dict()
    assert after.keys() == before.keys()
    for k, v in after.items():
        assert torch.equal(v, before[k]), k


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(LowRankLinear(20, 16, 4, dtype=F64), nn.Tanh(),
                         nn.Linear(16, 30).double())


# ----------------------------------------------------------------- hyperparameters
@pytest.mark.parametrize("cls", OPTIMIZERS)
@pytest.mark.parametrize("momentum", [1.5, 1.0, -0.1, math.nan])
def test_momentum_outside_0_1_is_rejected(cls, momentum):
    with pytest.raises(ValueError, match=r"`momentum` must be in \[0, 1\); got " + re.escape(str(momentum))):
        cls(LowRankLinear(4, 4, 2), 0.1, tau=0.1, momentum=momentum)


@pytest.mark.parametrize("cls", OPTIMIZERS)
@pytest.mark.parametrize("momentum", [0.0, 0.9, 0.999])
def test_valid_momentum_is_accepted(cls, momentum):
    cls(LowRankLinear(4, 4, 2), 0.1, tau=0.1, momentum=momentum)


@pytest.mark.parametrize("cls", OPTIMIZERS)
@pytest.mark.parametrize("kwargs,error,match", [
    (dict(weight_decay=-1e-4), ValueError, r"`weight_decay` must be a finite number >= 0.*got -0.0001"),
    (dict(weight_decay=math.inf), ValueError, r"`weight_decay` must be a finite number >= 0"),
    (dict(betas=(0.9, 1.0)), ValueError, r"`betas\[1\]` must be in \[0, 1\); got betas=\(0.9, 1.0\)"),
    (dict(betas=(-0.1, 0.999)), ValueError, r"`betas\[0\]` must be in \[0, 1\)"),
    (dict(betas=0.9), TypeError, r"`betas` must be a pair"),
    (dict(eps=0.0), ValueError, r"`eps` must be a finite number > 0.*got 0.0"),
    (dict(eps=-1e-8), ValueError, r"`eps` must be a finite number > 0"),
    (dict(optimizer="Adam"), ValueError,
     r"`optimizer` must be one of \['adam', 'adamw', 'muon', 'sgd'\]; got 'Adam'"),
    (dict(optimizer=torch.optim.Adam), TypeError, r"`optimizer` must be the name of an update rule"),
    (dict(momentum="0.9"), TypeError, r"`momentum` must be a real number; got '0.9'"),
])
def test_bad_hyperparameters_are_named(cls, kwargs, error, match):
    with pytest.raises(error, match=match):
        cls(LowRankLinear(4, 4, 2), 0.1, tau=0.1, **kwargs)


@pytest.mark.parametrize("cls", OPTIMIZERS)
@pytest.mark.parametrize("lr", [math.nan, math.inf, -0.1])
def test_lr_must_be_finite_and_non_negative(cls, lr):
    with pytest.raises(ValueError, match=r"`lr` must be a finite number >= 0; got " + re.escape(str(lr))):
        cls(LowRankLinear(4, 4, 2), lr, tau=0.1)


def test_existing_checks_are_kept():
    layer = LowRankLinear(4, 4, 2)
    with pytest.raises(ValueError, match="`tau_min`"):
        SDLRT(layer, 0.1, tau=0.1, tau_min=0.2)
    with pytest.raises(ValueError, match="`omega`"):
        SDLRT(layer, 0.1, tau=0.1, omega=0.0)
    DLRT(layer, torch.tensor(0.1), tau=0.1)  # a tensor lr, as torch optimizers allow


# ----------------------------------------------------------------- closures
@pytest.mark.parametrize("cls", OPTIMIZERS)
@pytest.mark.parametrize("single_pass", [True, False])
def test_closure_returning_none_raises_and_changes_nothing(cls, single_pass):
    model = _model()
    X, Y, _ = rank3_problem()
    opt = cls(model, 0.1, tau=0.1, momentum=0.9, single_pass=single_pass)
    opt.step(mse_closure(opt, model, X, Y))  # some optimizer state to keep, too
    before, opt_before = _snapshot(model), copy.deepcopy(opt.state_dict())

    def closure():
        opt.zero_grad()
        ((model(X) - Y) ** 2).sum(-1).mean().backward()  # forgets `return loss`

    with pytest.raises(TypeError, match="returned None; it must return the loss"):
        opt.step(closure)
    _assert_unchanged(model, before)
    _assert_same_state(opt.state_dict(), opt_before)  # momentum buffers included
    opt.step(mse_closure(opt, model, X, Y))  # and training goes on


@pytest.mark.parametrize("cls", OPTIMIZERS)
@pytest.mark.parametrize("single_pass", [True, False])
def test_closure_without_backward_raises_and_changes_nothing(cls, single_pass):
    model = _model()
    X, Y, _ = rank3_problem()
    opt = cls(model, 0.1, tau=0.1, momentum=0.9, single_pass=single_pass)
    opt.step(mse_closure(opt, model, X, Y))
    before, opt_before = _snapshot(model), copy.deepcopy(opt.state_dict())

    def closure():
        opt.zero_grad()
        return ((model(X) - Y) ** 2).sum(-1).mean()  # forgets loss.backward()

    with pytest.raises(RuntimeError, match=r"closure .* did not call backward\(\).*no weights were changed"):
        opt.step(closure)
    _assert_unchanged(model, before)
    _assert_same_state(opt.state_dict(), opt_before)
    opt.step(mse_closure(opt, model, X, Y))


def test_two_pass_second_closure_call_without_backward_restores_the_factors():
    model = _model()
    X, Y, _ = rank3_problem()
    opt = DLRT(model, 0.1, tau=0.1, momentum=0.9, single_pass=False)
    opt.step(mse_closure(opt, model, X, Y))
    before, K_state = _snapshot(model), opt.state[model[0].U]["m"].clone()
    calls = {"n": 0}

    def closure():
        calls["n"] += 1
        opt.zero_grad()
        loss = ((model(X) - Y) ** 2).sum(-1).mean()
        if calls["n"] == 1:
            loss.backward()
        return loss.detach()

    with pytest.raises(RuntimeError, match=r"did not call backward.*second call"):
        opt.step(closure)
    assert calls["n"] == 2
    _assert_unchanged(model, before)  # the augmented factors of the second pass are undone
    assert torch.equal(opt.state[model[0].U]["m"], K_state)


@pytest.mark.parametrize("cls", OPTIMIZERS)
def test_step_without_closure_and_without_backward_raises(cls):
    model = _model()
    opt = cls(model, 0.1, tau=0.1)
    before = _snapshot(model)
    with pytest.raises(RuntimeError, match=r"found no gradient.*call loss.backward\(\) before"):
        opt.step()
    _assert_unchanged(model, before)


@pytest.mark.parametrize("cls", OPTIMIZERS)
@pytest.mark.parametrize("single_pass", [True, False])
def test_unused_low_rank_layer_is_not_a_false_positive(cls, single_pass):
    torch.manual_seed(0)
    used, unused = LowRankLinear(20, 30, 4, dtype=F64), LowRankLinear(20, 30, 4, dtype=F64)
    model = nn.ModuleDict({"used": used, "unused": unused})
    X, Y, _ = rank3_problem()
    opt = cls(model, 0.1, tau=0.1, momentum=0.9, single_pass=single_pass)
    W_unused = unused.weight_matrix().detach().clone()
    for _ in range(3):
        W_used = used.weight_matrix().detach().clone()
        opt.step(mse_closure(opt, used, X, Y))
        assert not torch.equal(used.weight_matrix(), W_used)
    assert torch.equal(unused.weight_matrix(), W_unused)


def test_unused_low_rank_layer_with_dense_only_forward_still_steps():
    """Only dense parameters have gradients: that is a gradient, not a missing backward."""
    torch.manual_seed(0)
    model = nn.ModuleDict({"low": LowRankLinear(6, 6, 2), "head": nn.Linear(6, 2)})
    opt = DLRT(model, 0.1, tau=0.1)
    x = torch.randn(5, 6)
    w = model["head"].weight.detach().clone()

    def closure():
        opt.zero_grad()
        loss = model["head"](x).square().mean()
        loss.backward()
        return loss

    opt.step(closure)
    assert not torch.equal(model["head"].weight, w)


def test_update_every_core_steps_still_detect_missing_backward():
    model = _model()
    X, Y, _ = rank3_problem()
    opt = DLRT(model, 0.1, tau=0.1, update_every=2)
    opt.step(mse_closure(opt, model, X, Y))  # step 0 augments; step 1 is core-only
    before = _snapshot(model)

    def closure():
        opt.zero_grad()
        return ((model(X) - Y) ** 2).sum(-1).mean()

    with pytest.raises(RuntimeError, match="did not call backward"):
        opt.step(closure)
    _assert_unchanged(model, before)


def test_grad_scaler_skip_still_works():
    layer = LowRankLinear(8, 6, 2)
    opt = DLRT(layer, 0.1, tau=0.1)
    scaler = torch.amp.GradScaler("cpu", init_scale=1e38)
    W = layer.weight_matrix().detach().clone()
    opt.zero_grad()
    scaler.scale((layer(torch.randn(4, 8)) * 1e3).sum()).backward()
    scaler.step(opt)  # inf found: skipped, no error
    scaler.update()
    assert torch.equal(layer.weight_matrix().detach(), W)


# ----------------------------------------------------------------- to_low_rank
def _dense():
    torch.manual_seed(0)
    return nn.Sequential(nn.Conv2d(2, 4, 3, padding=1), nn.ReLU(), nn.Flatten(), nn.Linear(64, 3))


def test_to_low_rank_twice_raises_naming_the_layers():
    model = rankwise.to_low_rank(_dense(), rank=2)
    before = _snapshot(model)
    with pytest.raises(ValueError, match="already low-rank") as e:
        rankwise.to_low_rank(model, rank=3)
    msg = str(e.value)
    assert "'0' (LowRankConv2d, rank 2)" in msg and "'3' (LowRankLinear, rank 2)" in msg
    assert "only converts nn.Linear / nn.Conv2d" in msg and "max_rank" in msg
    _assert_unchanged(model, before)
    assert model[0].rank == 2 and model[3].rank == 2


@pytest.mark.parametrize("kw", [dict(rank=1.5), dict(rank=True), dict(rank=0), dict(rank="4"),
                                dict(rank=2, max_rank=2.0), dict(rank=2, max_rank=False)])
def test_to_low_rank_refuses_a_rank_that_is_not_an_int_at_least_1(kw):
    model = _dense()
    before = _snapshot(model)
    name = "max_rank" if "max_rank" in kw else "rank"
    with pytest.raises(ValueError, match=rf"`{name}` must be an int >= 1; got {re.escape(repr(kw[name]))}"):
        rankwise.to_low_rank(model, **kw)
    _assert_unchanged(model, before)
    assert isinstance(model[0], nn.Conv2d) and isinstance(model[3], nn.Linear)


def test_to_low_rank_on_a_low_rank_root_module_raises():
    with pytest.raises(ValueError, match=r"<root module> \(LowRankLinear, rank 2\)"):
        rankwise.to_low_rank(LowRankLinear(4, 4, 2), rank=3)


def test_to_low_rank_on_a_mixed_model_converts_the_dense_layers():
    model = _dense()
    model[3] = LowRankLinear(64, 3, 1)
    low = model[3]
    x = torch.randn(2, 2, 4, 4)
    rankwise.to_low_rank(model, rank=2)
    assert isinstance(model[0], LowRankConv2d) and model[0].rank == 2
    assert model[3] is low and low.rank == 1  # left as it was
    assert model(x).shape == (2, 3)


def test_to_low_rank_filters_matching_nothing_raise_naming_the_filters():
    model = _dense()
    with pytest.raises(ValueError, match=r"no nn.Linear / nn.Conv2d matching include=\['fc'\].*'0', '3'"):
        rankwise.to_low_rank(model, rank=2, include=["fc"])
    with pytest.raises(ValueError, match=r"matching exclude='.\*'"):
        rankwise.to_low_rank(model, rank=2, exclude=".*")
    assert type(model[0]) is nn.Conv2d and type(model[3]) is nn.Linear
    with pytest.raises(ValueError, match=r"the model has no nn\.Linear / nn\.Conv2d"):
        rankwise.to_low_rank(nn.Sequential(nn.ReLU()), rank=2)


def test_to_low_rank_with_only_inexpressible_convs_raises():
    model = nn.Sequential(nn.Conv2d(4, 4, 3, groups=2))
    with pytest.raises(ValueError, match=r"cannot express.*'0'"):
        rankwise.to_low_rank(model, rank=2)
    assert type(model[0]) is nn.Conv2d


def test_to_low_rank_accepts_a_generator_filter():
    model = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 8), nn.Linear(8, 8))
    rankwise.to_low_rank(model, rank=2, include=(n for n in ["0", "2"]))
    assert [type(m) for m in model] == [LowRankLinear, nn.Linear, LowRankLinear]


def test_one_tau_check_everywhere():
    """Every config and policy that takes a relative tolerance refuses the same values, naming
    the argument (rankwise._checks.check_unit_interval; the policies first check it is a finite
    real number)."""
    import math

    import pytest

    from rankwise import Tolerance
    from rankwise.experiments._sweep_spec import RunSpec
    from rankwise.linalg import truncated_svd
    from rankwise.peft import AdapterConfig
    from rankwise.train_config import TrainConfig

    makers = [lambda t: Tolerance(t), lambda t: TrainConfig(tau=t), lambda t: AdapterConfig(["q"], tau=t),
              lambda t: RunSpec(tau=t), lambda t: truncated_svd(__import__("torch").eye(3), tau=t)]
    for make in makers:
        for bad in (1.0, -0.1, math.nan):
            with pytest.raises(ValueError, match=r"`tau` must be (in \[0, 1\)|finite); got"):
                make(bad)


def test_train_config_dict_round_trip(tmp_path):
    from rankwise.train_config import TrainConfig

    c = TrainConfig(method="sdlrt", exclude=("fc2",), out=tmp_path / "o", checkpoint_every=5,
                    checkpoint_dir=tmp_path / "ck")
    assert TrainConfig.from_dict(c.to_dict()) == c


def _xent_closure(model, opt):
    x, y = torch.randn(64, 20, generator=torch.Generator().manual_seed(1)), torch.arange(64) % 5
    return xent_closure(opt, model, x, y)


@pytest.mark.parametrize("cls", OPTIMIZERS)
@pytest.mark.parametrize("family", [dict(optimizer="adam"), dict(momentum=0.9)])
def test_optimizer_state_saved_at_other_ranks_is_refused_before_anything_loads(cls, family):
    def trained(rank, steps):
        torch.manual_seed(0)
        model = rankwise.to_low_rank(nn.Sequential(nn.Linear(20, 20), nn.ReLU(), nn.Linear(20, 5)), rank=rank)
        opt = cls(model, lr=0.05, tau=0.05, **family)
        for _ in range(steps):
            opt.step(_xent_closure(model, opt))
        return model, opt

    model, opt = trained(4, 3)
    saved, rank = opt.state_dict(), model[0].rank
    assert rank != 2
    other, other_opt = trained(2, 1)
    before = copy.deepcopy(other_opt.state_dict())
    with pytest.raises(ValueError, match=rf"layer '0' at rank {rank} \(its K moments are 20×{rank}\), "
                                         r"but the layer is at rank 2 now: load the model's state_dict"):
        other_opt.load_state_dict(saved)
    _assert_same_state(other_opt.state_dict(), before)  # nothing loaded
    other_opt.step(_xent_closure(other, other_opt))  # and it still trains
    other.load_state_dict(model.state_dict())  # in the right order the same state is taken
    fresh = cls(other, lr=0.05, tau=0.05, **family)
    fresh.load_state_dict(saved)
    fresh.step(_xent_closure(other, fresh))
