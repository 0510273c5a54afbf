"""Decoupled weight decay (AdamW) in the rules and presets, and RankwiseTrainer as HF's Trainer
behaves: AdamW with HF's no-decay group, the caller's arguments untouched, to_low_rank models
(issue items 18, 19, 20, and the Hugging Face causal-LM example)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch
from torch import nn

import rankwise
from helpers import F64, step_beside_torch
from rankwise.nn import LowRankLinear
from rankwise.optim import DLRT, AdamW, Settings
from rankwise.optim.rules._rules import adam, foreach_update

ROOT = Path(__file__).resolve().parents[2]


# ----------------------------------------------------------------------------- item 18: the rule
def _reference_adamw(p, grads, lr, betas, eps, wd):
    """torch.optim.AdamW's algorithm, written out in float64: p ← p − lr·wd·p, then Adam's
    step of the plain gradient."""
    b1, b2 = betas
    m, v, out = torch.zeros_like(p), torch.zeros_like(p), []
    for t, g in enumerate(grads, start=1):
        p = p - lr * wd * p
        m = b1 * m + (1 - b1) * g
        v = b2 * v + (1 - b2) * g * g
        p = p - lr * (m / (1 - b1**t)) / ((v / (1 - b2**t)).sqrt() + eps)
        out.append(p)
    return out


def test_adam_rule_with_decoupled_decay_matches_a_hand_written_reference():
    g = torch.Generator().manual_seed(0)
    p0 = torch.randn(5, 3, dtype=F64, generator=g)
    grads = [torch.randn(5, 3, dtype=F64, generator=g) for _ in range(5)]
    hp = dict(lr=0.05, betas=(0.9, 0.99), eps=1e-8, weight_decay=0.3, decoupled_weight_decay=True)
    want = _reference_adamw(p0, grads, 0.05, (0.9, 0.99), 1e-8, 0.3)
    p, st, q, sts = p0.clone(), {}, [p0.clone(), 2 * p0], [{}, {}]
    for t, gr in enumerate(grads):
        d, st = adam(gr, p, st, hp)
        p = p + d
        torch.testing.assert_close(p, want[t], rtol=0, atol=1e-14)
        ds, sts = foreach_update("adamw", [gr, gr], q, sts, hp)
        q = [a + b for a, b in zip(q, ds, strict=True)]
        torch.testing.assert_close(q[0], p, rtol=0, atol=1e-14)
    # the L2 form is unchanged, also for groups saved before the key existed
    l2 = {k: v for k, v in hp.items() if k != "decoupled_weight_decay"}
    d_old, _ = adam(grads[0], p0, {}, l2)
    d_false, _ = adam(grads[0], p0, {}, {**l2, "decoupled_weight_decay": False})
    gg = grads[0] + 0.3 * p0
    torch.testing.assert_close(d_old, -0.05 * gg / (gg.abs() + 1e-8), rtol=1e-12, atol=0)
    assert torch.equal(d_old, d_false)


@pytest.mark.parametrize("kind", ["adamw", "adam-decoupled", "adamw-groups"])
def test_dense_parameters_follow_torch_adamw(kind):
    """Non-low-rank parameters take exactly torch.optim.AdamW's (and Adam(decoupled_weight_decay=
    True)'s) steps, with a param group's own decay and rate."""
    torch.manual_seed(1)
    model = nn.Sequential(LowRankLinear(6, 5, 2, dtype=F64), nn.LayerNorm(5, dtype=F64),
                          nn.Linear(5, 2).double())
    ref = nn.Sequential(nn.LayerNorm(5, dtype=F64), nn.Linear(5, 2).double())
    ref.load_state_dict(nn.Sequential(model[1], model[2]).state_dict())
    lr, hp = 0.01, dict(betas=(0.9, 0.99), eps=1e-8, weight_decay=0.2)
    if kind == "adam-decoupled":
        opt = DLRT(model, lr, tau=0.1, adaptive=False, optimizer="adam", decoupled_weight_decay=True, **hp)
        torch_opt = torch.optim.Adam(ref.parameters(), lr, decoupled_weight_decay=True, **hp)
    elif kind == "adamw":
        opt = DLRT(model, lr, tau=0.1, adaptive=False, optimizer="adamw", **hp)
        torch_opt = torch.optim.AdamW(ref.parameters(), lr, **hp)
    else:
        opt = DLRT(model, lr, tau=0.1, adaptive=False, optimizer="adamw", **hp,
                   param_groups=[{"params": model[1].parameters(), "weight_decay": 0.0, "lr": 0.03}])
        groups = [{"params": ref[1].parameters()},
                  {"params": ref[0].parameters(), "weight_decay": 0.0, "lr": 0.03}]
        torch_opt = torch.optim.AdamW(groups, lr, **hp)
    step_beside_torch(opt, torch_opt, model, ref)
    for a, b in zip(nn.Sequential(model[1], model[2]).parameters(), ref.parameters(), strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-12)


@pytest.mark.parametrize("update_every", [1, 2])
def test_a_low_rank_weight_decays_as_under_adamw(update_every):
    """With zero gradients Adam's step is zero and only the decoupled decay acts: W = U S Vᵀ
    shrinks by (1 − lr·wd) per step, as a dense weight under torch.optim.AdamW (the L2 form
    would take a sign-like Adam step of wd·W instead)."""
    torch.manual_seed(0)
    layer = LowRankLinear(8, 6, 3, bias=False, dtype=F64)
    W0 = (layer.U @ layer.S @ layer.V.T).detach().clone()
    lr, wd = 0.1, 0.5
    opt = DLRT(layer, lr, tau=0.0, adaptive=False, optimizer="adamw", weight_decay=wd,
               update_every=update_every)
    x = torch.randn(4, 8, dtype=F64)

    def closure():
        opt.zero_grad()
        loss = 0.0 * layer(x).sum()
        loss.backward()
        return loss.detach()

    for t in range(1, 4):
        opt.step(closure)
        W = layer.U @ layer.S @ layer.V.T
        torch.testing.assert_close(W, (1 - lr * wd) ** t * W0, rtol=1e-10, atol=1e-12)


def test_presets_and_settings_take_adamw():
    model = nn.Sequential(LowRankLinear(6, 5, 2, dtype=F64))
    opt = DLRT(model, 0.1, tau=0.1, optimizer="adamw", weight_decay=0.05)
    assert opt.settings.rule == AdamW(weight_decay=0.05)
    group = opt.param_groups[0]
    assert group["weight_decay"] == 0.05 and group["decoupled_weight_decay"] is True
    assert DLRT(model, 0.1, tau=0.1, optimizer="adamw").settings.rule.weight_decay == 0.01  # torch's default
    assert DLRT(model, 0.1, tau=0.1, optimizer="adam").settings.rule.decoupled_weight_decay is False
    assert Settings.from_dict(opt.settings.to_dict()) == opt.settings
    again = DLRT(model, 0.1, tau=0.1, optimizer="adamw", weight_decay=0.05)
    again.load_state_dict(opt.state_dict())
    assert again.param_groups[0]["decoupled_weight_decay"] is True
    with pytest.raises(ValueError, match="decoupled_weight_decay` is Adam's"):
        DLRT(model, 0.1, tau=0.1, optimizer="sgd", decoupled_weight_decay=True)
    with pytest.raises(TypeError, match="decoupled_weight_decay` must be True or False"):
        rankwise.Adam(decoupled_weight_decay=1)


# ----------------------------------------------------------------------------- items 19, 20: the Trainer
transformers = pytest.importorskip("transformers")


def _args(tmp_path, **kw) -> transformers.TrainingArguments:
    base = dict(output_dir=str(tmp_path / "out"), max_steps=3, learning_rate=0.01,
                per_device_train_batch_size=4, report_to=[], save_strategy="no", use_cpu=True,
                disable_tqdm=True, logging_steps=1)
    return transformers.TrainingArguments(**{**base, **kw})


def _bert_adapters():
    from rankwise.peft import AdapterConfig, get_adapter_model

    torch.manual_seed(0)
    cfg = transformers.BertConfig(vocab_size=50, hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
                                  intermediate_size=48, max_position_embeddings=32, num_labels=3)
    model = transformers.BertForSequenceClassification(cfg)
    config = AdapterConfig(["query", "value"], r=4, tau=0.05, modules_to_save=["classifier"])
    return get_adapter_model(model, config)


def _bert_data(n: int = 8) -> list[dict]:
    g = torch.Generator().manual_seed(0)
    ids, y = torch.randint(0, 50, (n, 12), generator=g), torch.randint(0, 3, (n,), generator=g)
    return [{"input_ids": ids[i], "labels": y[i]} for i in range(n)]


def _llama():
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                   num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=32)
    return rankwise.to_low_rank(transformers.LlamaForCausalLM(cfg), rank=8)


def _lm_data(n: int = 8) -> list[dict]:
    ids = torch.randint(0, 64, (n, 16), generator=torch.Generator().manual_seed(0))
    return [{"input_ids": ids[i], "labels": ids[i]} for i in range(n)]


def _opt(trainer):
    return getattr(trainer.optimizer, "optimizer", trainer.optimizer)  # accelerate wraps it


def test_trainer_never_changes_the_callers_arguments(tmp_path):
    from rankwise.peft import RankwiseTrainer

    args = _args(tmp_path, max_grad_norm=0.5)
    trainer = RankwiseTrainer(model=_bert_adapters(), args=args, train_dataset=_bert_data())
    assert args.max_grad_norm == 0.5 and trainer.args.max_grad_norm == 0.5 and trainer.clip_norm == 0.5
    trainer.train()
    assert args.max_grad_norm == 0.5
    again = RankwiseTrainer(model=_bert_adapters(), args=args, train_dataset=_bert_data())  # reused args
    assert again.clip_norm == 0.5
    logged = [e["grad_norm"] for e in trainer.state.log_history if "grad_norm" in e]
    assert logged and all(float(v) > 0 for v in logged)  # rankwise's norm, factor gradients included


def test_trainer_weight_decay_is_adamw_with_hfs_no_decay_group(tmp_path):
    """HF's weight_decay is decoupled, as the Trainer's torch.optim.AdamW, and spares exactly the
    parameters the Trainer spares (biases, LayerNorm)."""
    from rankwise.peft import RankwiseTrainer

    model, args = _bert_adapters(), _args(tmp_path, weight_decay=0.1, adam_beta2=0.99, adam_epsilon=1e-7)
    opt = RankwiseTrainer(model=model, args=args, train_dataset=_bert_data()).create_optimizer()
    assert opt.settings.rule == AdamW(betas=(0.9, 0.99), eps=1e-7, weight_decay=0.1)
    hf = transformers.Trainer(model=model, args=args, train_dataset=_bert_data()).create_optimizer()
    assert type(hf) is torch.optim.AdamW
    spared = {id(p) for g in opt.param_groups if g["weight_decay"] == 0.0 for p in g["params"]}
    hf_spared = {id(p) for g in hf.param_groups if g["weight_decay"] == 0.0 for p in g["params"]}
    assert spared == hf_spared and spared  # biases and LayerNorm weights
    assert all(g["decoupled_weight_decay"] for g in opt.param_groups)
    assert opt.param_groups[0]["weight_decay"] == 0.1


@pytest.mark.parametrize("method,cls", [("dlrt", rankwise.DLRT), ("sdlrt", rankwise.SDLRT)])
def test_trainer_trains_a_to_low_rank_model(tmp_path, method, cls):
    from rankwise.peft import RankwiseTrainer

    model = _llama()
    layers = {n: m for n, m in model.named_modules() if isinstance(m, rankwise.AbstractLowRankLayer)}
    assert len(layers) == 8  # q, k, v, o, gate, up, down, lm_head
    before = {n: m.U.detach().clone() for n, m in layers.items()}
    args = _args(tmp_path, weight_decay=0.01)
    trainer = RankwiseTrainer(model=model, args=args, train_dataset=_lm_data(),
                              integrator={"method": method, "tau": 0.2})
    trainer.train()
    opt = _opt(trainer)
    assert type(opt) is cls and opt.settings.rule == AdamW(weight_decay=0.01)
    assert all(not torch.equal(before[n], m.U) for n, m in layers.items())  # the integrator moved the bases
    assert opt.ranks() == {n: m.rank for n, m in layers.items()}
    logged = [e for e in trainer.state.log_history if "rank_total" in e]
    assert logged and logged[-1]["rank_total"] == sum(m.rank for m in layers.values())
    assert all(f"rank/{n}" in logged[-1] for n in layers) and "tau_mean" in logged[-1]
    norms = {id(p) for n, p in model.named_parameters() if "norm" in n}
    spared = {id(p) for g in opt.param_groups if g["weight_decay"] == 0.0 for p in g["params"]}
    assert norms and norms <= spared


def test_trainer_refuses_what_it_cannot_do_in_one_line(tmp_path):
    from rankwise.peft import RankwiseTrainer

    cases = [
        (dict(model=nn.Linear(2, 2)), "has no rankwise layers"),
        (dict(model=_llama()), r"needs the integrator's truncation: .*integrator=\{'tau': 0.1\}"),
        (dict(model=_llama(), integrator={"tau": 0.1, "weight_decay": 0.1}), "set it there"),
        (dict(model=_llama(), integrator={"tau": 0.1, "method": "adalora"}), "must be one of"),
        (dict(model=_bert_adapters(), integrator={"tau": 0.1}), "come from its AdapterConfig"),
        (dict(model=_llama(), integrator={"tau": 0.1}, args=_args(tmp_path, optim="sgd")),
         r"optim='sgd'\) is not supported"),
        (dict(model=_llama(), integrator={"tau": 0.1}, optimizer_cls_and_kwargs=(torch.optim.SGD, {})),
         "optimizer_cls_and_kwargs is not supported"),
    ]
    for kw, message in cases:
        kw.setdefault("args", _args(tmp_path))
        with pytest.raises(ValueError, match=message) as err:
            RankwiseTrainer(train_dataset=_lm_data(), **kw)
        assert "\n" not in str(err.value)


# ----------------------------------------------------------------------------- the example
def _example():
    spec = importlib.util.spec_from_file_location("hf_causal_lm", ROOT / "examples" / "hf_causal_lm.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_hf_causal_lm_example_trains_gpt2_in_low_rank(capsys):
    out = _example().main(["--steps", "4", "--width", "32", "--layers", "1", "--context", "16",
                           "--batch", "4", "--rank", "4", "--bytes", "2000", "--lr", "0.01"])
    assert out["loss_after"] < out["loss_before"]
    # GPT-2's Conv1D projections (c_attn, c_proj, c_fc) are converted, and lm_head
    assert {n.rsplit(".", 1)[-1] for n in out["ranks"]} >= {"c_attn", "c_proj", "c_fc", "lm_head"}
    assert 0 < out["compression"] < 1
    printed = capsys.readouterr().out
    assert "before" in printed and "compression" in printed


def test_hf_causal_lm_example_text_without_the_corpus(monkeypatch):
    example = _example()
    monkeypatch.setattr(example.importlib.util, "find_spec", lambda name: None)
    text = example.corpus(500)
    assert len(text) == 500 and text.decode().startswith(tuple(["the", "model", "learns", "a", "low", "rank",
                                                                "weight", "while", "integrator", "adapts",
                                                                "each", "as", "training", "goes"]))
    assert [len(b["input_ids"]) for b in example.blocks(text, 16)] == [16] * 31


def test_a_target_is_reached_within_the_trainers_steps(tmp_path):
    """RankwiseTrainer(integrator={"target": 0.6}) with max_steps=16 ended at 0.076 (the budget
    ramped over DLRT's default 200 augmentations); the ramp now follows the run's length."""
    from rankwise.peft import RankwiseTrainer

    model = _llama()
    trainer = RankwiseTrainer(model=model, args=_args(tmp_path, max_steps=6), train_dataset=_lm_data(),
                              integrator={"target": 0.6})
    trainer.train()
    assert _opt(trainer).budget()["target_params"] >= rankwise.compression(model)["stored_params"] - 1
    assert rankwise.compression(model)["ratio"] == pytest.approx(0.6, abs=0.02)
