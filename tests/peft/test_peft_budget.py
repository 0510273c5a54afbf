"""Adapters that count and scale like PEFT's: trainable_parameters, a parameter budget held at
every step, and an optimizer that holds only what is trained (tiny random-init BERT)."""

from __future__ import annotations

import re

import pytest
import torch
from torch import nn

from rankwise.nn._budget import layer_cost
from rankwise.peft import (
    AdapterConfig,
    adapter_budget,
    adapter_optimizer,
    adapters,
    get_adapter_model,
    print_trainable_parameters,
    trainable_parameters,
)

transformers = pytest.importorskip("transformers")
from test_peft import QKV, batch, tiny_bert  # noqa: E402  (the shared tiny model, after the skip)

# Linear layers of three shapes: 32×32 (q, k, v, attention output), 48×32, 32×48
SHAPED = ["query", "key", "value", "attention.output.dense", "intermediate.dense", "layer.0.output.dense",
          "layer.1.output.dense"]


def head_params(model) -> int:
    return sum(p.numel() for n, p in model.named_parameters() if n.startswith("classifier."))


def adapter_params(model) -> int:
    """U, S, V and the buffer of every adapter, counted from the tensors."""
    return sum(t.numel() for _, m in adapters(model) for t in (m.U, m.S, m.V, m.U_buf, m.V_buf))


def step(model, opt, seed: int) -> float:
    ids, y = batch(seed)

    def closure():
        opt.zero_grad()
        loss = nn.functional.cross_entropy(model(input_ids=ids).logits, y)
        loss.backward()
        return loss

    return float(opt.step(closure).detach())


# ------------------------------------------------------------------------- (a) counting
def test_trainable_parameters_count_the_factors_whatever_their_requires_grad():
    config = AdapterConfig(QKV, r=4, method="sdlrt", modules_to_save=["classifier"])
    model = get_adapter_model(tiny_bert(), config)
    base_total = sum(p.numel() for p in tiny_bert().parameters())
    by_hand = 6 * (4 * 32 + 4 * 4 + 4 * 32) + (32 * 3 + 3)  # six 32×32 adapters at rank 4, the head
    # before an optimizer U and V require grad: the plain requires_grad count is an independent reference
    assert sum(p.numel() for p in model.parameters() if p.requires_grad) == by_hand
    assert trainable_parameters(model) == (by_hand, base_total + 6 * (4 * 64 + 16))
    opt = adapter_optimizer(model, 0.05, momentum=0.9)
    # in core steps (update_every > 1) the integrator switches U and V's requires_grad off:
    # counting requires_grad would miss them
    for layer in (m for _, m in adapters(model)):
        layer.set_grad_mode("core")
    assert sum(p.numel() for p in model.parameters() if p.requires_grad) == 6 * 16 + 32 * 3 + 3
    assert trainable_parameters(model)[0] == by_hand
    for layer in (m for _, m in adapters(model)):
        layer.set_grad_mode("factors")
    for i in range(3):
        step(model, opt, i)
    ranks = {n: m.rank for n, m in adapters(model)}
    bufs = {n: m.U_buf.shape[1] for n, m in adapters(model)}
    assert any(bufs.values())  # SDLRT's buffer is filled
    trainable, total = trainable_parameters(model)
    want = sum(r * 64 + r * r + bufs[n] * 64 for n, r in ranks.items()) + 32 * 3 + 3
    assert trainable == want == adapter_params(model) + head_params(model)
    assert total == base_total + sum(r * 64 + r * r + bufs[n] * 64 for n, r in ranks.items())


def test_trainable_parameters_equal_peft_on_peft_models(capsys):
    peft = pytest.importorskip("peft")
    for config in (peft.LoraConfig(r=4, lora_alpha=4, target_modules=QKV, modules_to_save=["classifier"]),
                   peft.AdaLoraConfig(init_r=6, target_r=4, total_step=10, target_modules=QKV)):
        model = peft.get_peft_model(tiny_bert(), config)
        assert trainable_parameters(model) == model.get_nb_trainable_parameters()
        model.print_trainable_parameters()
        theirs = capsys.readouterr().out
        print_trainable_parameters(model)
        assert capsys.readouterr().out == theirs
    model = get_adapter_model(tiny_bert(), AdapterConfig(QKV, r=4))
    print_trainable_parameters(model)
    line = capsys.readouterr().out
    trainable, total = trainable_parameters(model)
    assert re.fullmatch(r"trainable params: [\d,]+ \|\| all params: [\d,]+ \|\| trainable%: \d+\.\d{4}\n",
                        line)
    assert f"trainable params: {trainable:,d} || all params: {total:,d}" in line
    assert trainable == 6 * (4 * 64 + 16)  # no head trained: only the adapters


def test_a_shared_parameter_counts_once():
    lin = nn.Linear(4, 4)
    model = nn.Sequential(lin, nn.ReLU(), lin)
    assert trainable_parameters(model) == (20, 20)
    lin.bias.requires_grad_(False)
    assert trainable_parameters(model) == (16, 20)
    with pytest.raises(TypeError, match=r"nn\.Module"):
        trainable_parameters("model")


# ------------------------------------------------------------------------- (b) the budget
def test_budget_is_checked_and_round_trips():
    for bad, match in (("lora:0", "lora:R"), ("lora:x", "lora:R"), ("LoRA 10", "lora:R"), (0, "int >= 1"),
                       (True, "int >= 1"), (2.5, "int >= 1")):
        with pytest.raises(ValueError, match=match):
            AdapterConfig(QKV, budget=bad)
    for budget in ("lora:4", 5000):
        config = AdapterConfig(QKV, budget=budget, method="dlrt", max_rank=3, modules_to_save=["classifier"])
        assert AdapterConfig.from_json(config.to_json()) == config
        assert AdapterConfig.from_json(config.to_json()).budget == budget
    with pytest.raises(ValueError, match="cannot hold the 6 adapted layers at rank 1: that costs 390"):
        get_adapter_model(tiny_bert(), AdapterConfig(QKV, budget=389, method="dlrt"))
    with pytest.raises(ValueError, match=r"rank 1: that costs 774 \(U, S, V, and the buffer\)"):
        get_adapter_model(tiny_bert(), AdapterConfig(QKV, budget=773, method="sdlrt"))


@pytest.mark.parametrize("method", ["dlrt", "sdlrt"])
def test_budget_starts_at_the_largest_uniform_rank_that_fits(method):
    model = get_adapter_model(tiny_bert(), AdapterConfig(SHAPED, budget="lora:4", method=method))
    shapes = [(m.out_features, m.in_features) for _, m in adapters(model)]
    assert len(shapes) == 12 and {(32, 32), (48, 32), (32, 48)} == set(shapes)
    budget = sum(4 * (m + n) for m, n in shapes)  # LoRA at rank 4 on the same layers
    assert adapter_budget(model) == budget
    buffer = method == "sdlrt"

    def cost(r):  # one rank for all: U, S, V (and the buffer at its largest, b = r)
        return sum(r * (m + n) + r * r + (r * (m + n) if buffer else 0) for m, n in shapes)

    fits = [r for r in range(1, 33) if cost(r) <= budget]
    assert {m.rank for _, m in adapters(model)} == {max(fits)}
    assert max(fits) == (3 if method == "dlrt" else 1)  # r² (and the buffer) cost more than LoRA's
    roomy = get_adapter_model(tiny_bert(), AdapterConfig(SHAPED, budget=10**6, method=method))
    assert all(m.rank == 32 for _, m in adapters(roomy))  # clamped to min(out, in)


@pytest.mark.parametrize("method", ["dlrt", "sdlrt"])
def test_budget_holds_at_every_step_while_ranks_move_between_layers(method):
    torch.manual_seed(0)
    model = get_adapter_model(tiny_bert(), AdapterConfig(SHAPED, budget="lora:6", method=method,
                                                         modules_to_save=["classifier"]))
    budget = adapter_budget(model)
    opt = adapter_optimizer(model, 0.02, optimizer="adam")
    assert adapter_params(model) <= budget
    buffer = method == "sdlrt"
    differed, losses = False, []
    for i in range(10):
        losses.append(step(model, opt, i % 3))
        layers = [m for _, m in adapters(model)]
        assert adapter_params(model) <= budget, i  # buffer columns counted as they are
        assert trainable_parameters(model)[0] == adapter_params(model) + head_params(model)
        # the allocation, as the budget costs it (buffer at its largest), is within the budget and
        # maximal: no layer below full rank could take one more direction
        spent = sum(layer_cost(m.out_features, m.in_features, m.rank, buffer=buffer) for m in layers)
        assert spent <= budget
        for m in layers:
            if m.rank < min(m.out_features, m.in_features):
                extra = (layer_cost(m.out_features, m.in_features, m.rank + 1, buffer=buffer)
                         - layer_cost(m.out_features, m.in_features, m.rank, buffer=buffer))
                assert spent + extra > budget, (i, m.rank)
        differed |= len({m.rank for m in layers}) > 1
    assert differed  # ranks moved between the modules
    assert all(torch.isfinite(torch.tensor(losses)))


# ------------------------------------------------------------------------- (d) what the optimizer holds
@pytest.mark.parametrize("budget", [None, "lora:4"])
def test_the_optimizer_leaves_frozen_parameters_alone(budget, tmp_path):
    """The adapter optimizer holds every parameter, as ``torch.optim.AdamW(model.parameters())``
    does (so a base layer unfrozen later trains), and a step moves only those with gradients."""
    config = AdapterConfig(QKV, r=4, budget=budget, modules_to_save=["classifier"])
    model = get_adapter_model(tiny_bert(), config)
    opt = adapter_optimizer(model, 0.02, optimizer="adam")
    held = [p for g in opt.param_groups for p in g["params"]]
    factors = {id(t) for _, m in adapters(model) for t in (m.U, m.S, m.V)}
    head = {id(p) for p in model.classifier.parameters()}
    assert {id(p) for p in held} == {id(p) for p in model.parameters()}
    assert len(held) == len(set(map(id, held)))
    frozen = [p for p in model.parameters() if id(p) not in factors | head]
    assert frozen and not any(p.requires_grad for p in frozen)
    before = [p.clone() for p in frozen]
    for i in range(3):
        step(model, opt, i)
    assert all(torch.equal(a, b) for a, b in zip(before, frozen, strict=True))
    assert opt.state.get(model.classifier.weight)  # the head trains
    state = opt.state_dict()  # an optimizer state round-trips into an optimizer built the same way
    assert len(state["param_groups"][0]["params"]) == len(held)
    again = adapter_optimizer(model, 0.02, optimizer="adam")
    again.load_state_dict(state)
    assert again.state_dict()["param_groups"][0]["global_step"] == 3


def test_allocation_needs_a_budget():
    model = get_adapter_model(tiny_bert(), AdapterConfig(QKV, r=2))
    with pytest.raises(ValueError, match="applies to adapters with a budget"):
        adapter_optimizer(model, 0.1, allocation="uniform")
