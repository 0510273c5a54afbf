"""Rank-adaptive adapters on a tiny random-init BERT (no files needed)."""

from __future__ import annotations

import json

import pytest
import torch
from torch import nn

import rankwise
from rankwise.peft import (
    AdapterConfig,
    AdapterLinear,
    adapter_optimizer,
    adapters,
    export_peft_lora,
    get_adapter_model,
    load_adapter,
    merge_and_unload,
    save_adapter,
)

transformers = pytest.importorskip("transformers")  # the rankwise[peft] extra; make test installs it

QKV = ["query", "key", "value"]


def tiny_bert(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    cfg = transformers.BertConfig(vocab_size=50, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                                  intermediate_size=48, max_position_embeddings=32, num_labels=3)
    return transformers.BertForSequenceClassification(cfg).eval()


def batch(seed: int = 0, n: int = 8):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 50, (n, 12), generator=g), torch.randint(0, 3, (n,), generator=g)


def logits(model, ids):
    with torch.no_grad():
        return model(input_ids=ids).logits


def trained(config: AdapterConfig, steps: int = 6, seed: int = 0, lr: float = 0.05):
    model = get_adapter_model(tiny_bert(seed), config)
    model.train()
    opt = adapter_optimizer(model, lr, momentum=0.9)
    ids, y = batch()
    losses = []
    for _ in range(steps):
        def closure():
            opt.zero_grad()
            loss = nn.functional.cross_entropy(model(input_ids=ids).logits, y)
            loss.backward()
            return loss
        losses.append(float(opt.step(closure).detach()))
    return model.eval(), opt, losses


def test_wrapping_keeps_the_output_and_freezes_all_but_the_adapters():
    base = tiny_bert()
    ids, _ = batch()
    before = logits(base, ids)
    model = get_adapter_model(tiny_bert(), AdapterConfig(QKV, r=4, modules_to_save=["classifier"]))
    assert torch.equal(logits(model, ids), before)  # S = 0: exactly the base model
    names = [n for n, _ in adapters(model)]
    assert len(names) == 6 and all(n.split(".")[-1] in QKV for n in names)
    for _, layer in adapters(model):  # orthonormal bases, zero core
        assert torch.allclose(layer.U.mT @ layer.U, torch.eye(4), atol=1e-5)
        assert torch.allclose(layer.V.mT @ layer.V, torch.eye(4), atol=1e-5) and not layer.S.any()
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    assert trainable == {f"{n}.{k}" for n in names for k in "USV"} | {"classifier.weight", "classifier.bias"}


def test_target_selection_follows_peft_and_bad_targets_say_what_exists():
    regex = get_adapter_model(tiny_bert(), AdapterConfig(r".*layer\.0\.attention\.self\.(query|value)", r=2))
    assert [n for n, _ in adapters(regex)] == ["bert.encoder.layer.0.attention.self.query",
                                              "bert.encoder.layer.0.attention.self.value"]
    with pytest.raises(ValueError, match=r"matches no nn\.Linear.*attention\.self\.query"):
        get_adapter_model(tiny_bert(), AdapterConfig(["q_proj"]))
    with pytest.raises(ValueError, match="modules_to_save"):
        get_adapter_model(tiny_bert(), AdapterConfig(QKV, modules_to_save=["head"]))
    with pytest.raises(ValueError, match="regular expression"):
        AdapterConfig("query(")
    config = AdapterConfig(QKV, r=3, tau=0.05, modules_to_save=["classifier"])
    assert AdapterConfig.from_json(config.to_json()) == config


@pytest.mark.parametrize("method", ["dlrt", "sdlrt"])
def test_training_lowers_the_loss_and_changes_the_ranks(method):
    config = AdapterConfig(QKV, r=4, tau=0.05, method=method, modules_to_save=["classifier"])
    model, opt, losses = trained(config, steps=15, lr=0.5)
    assert losses[-1] < 0.8 * losses[0]
    assert any(r != 4 for r in opt.ranks().values())  # the integrator ran on the adapters
    base = tiny_bert()
    for name, p in base.named_parameters():  # the base weights did not move
        if "classifier" not in name:
            assert torch.equal(p, model.get_parameter(name.replace(".weight", ".base.weight").replace(
                ".bias", ".base.bias")) if _adapted(model, name) else model.get_parameter(name))


def _adapted(model, param_name: str) -> bool:
    module = param_name.rsplit(".", 1)[0]
    return isinstance(model.get_submodule(module), AdapterLinear)


def test_save_load_with_other_ranks_and_merge(tmp_path):
    config = AdapterConfig(QKV, r=4, tau=0.05, modules_to_save=["classifier"])
    model, _, _ = trained(config)
    ids, _ = batch(1)
    want = logits(model, ids)
    save_adapter(model, tmp_path / "a")
    fresh = get_adapter_model(tiny_bert(), AdapterConfig(QKV, r=2, modules_to_save=["classifier"]))
    load_adapter(fresh, tmp_path / "a")  # ranks differ from the saved ones
    assert {n: m.rank for n, m in adapters(fresh)} == {n: m.rank for n, m in adapters(model)}
    assert torch.allclose(logits(fresh, ids), want, atol=1e-6)
    merged = merge_and_unload(fresh)
    assert not any(True for _ in adapters(merged))
    assert type(merged.bert.encoder.layer[0].attention.self.query) is nn.Linear
    assert torch.allclose(logits(merged, ids), want, atol=1e-5)
    with pytest.raises(ValueError, match="no rankwise adapters"):
        save_adapter(tiny_bert(), tmp_path / "b")


def test_export_loads_in_stock_peft_with_the_same_outputs(tmp_path):
    peft = pytest.importorskip("peft")
    model, _, _ = trained(AdapterConfig(QKV, r=4, tau=0.05, alpha=2.0, modules_to_save=["classifier"]))
    ids, _ = batch(2)
    want = logits(model, ids)
    ranks = {n: m.rank for n, m in adapters(model)}
    export_peft_lora(model, tmp_path / "lora")
    loaded = peft.PeftModel.from_pretrained(tiny_bert(), str(tmp_path / "lora")).eval()
    assert torch.allclose(logits(loaded, ids), want, atol=1e-5)
    assert {n: m.rank for n, m in adapters(model)} == ranks  # the export did not change the model
    assert torch.equal(logits(model, ids), want)


def test_import_rankwise_does_not_import_transformers():
    import subprocess
    import sys

    code = ("import rankwise, rankwise.peft, sys; "
            "assert 'transformers' not in sys.modules and 'peft' not in sys.modules")
    subprocess.run([sys.executable, "-c", code], check=True)
    assert rankwise.DLRT  # the core is still there


def test_trainer_runs_the_integrator_without_extra_calls(tmp_path):
    from rankwise.peft import RankwiseTrainer

    model = get_adapter_model(tiny_bert(), AdapterConfig(QKV, r=4, tau=0.05, modules_to_save=["classifier"]))
    ids, y = batch(0, n=16)
    data = [{"input_ids": ids[i], "labels": y[i]} for i in range(len(y))]
    args = transformers.TrainingArguments(output_dir=str(tmp_path / "out"), max_steps=6, learning_rate=0.02,
                                          per_device_train_batch_size=8, logging_steps=2, report_to=[],
                                          save_strategy="no", use_cpu=True, disable_tqdm=True)
    trainer = RankwiseTrainer(model=model, args=args, train_dataset=data)
    # clipped by rankwise (factor gradients included); the caller's arguments are untouched
    assert trainer.clip_norm == 1.0 and trainer.args.max_grad_norm == 1.0 and args.max_grad_norm == 1.0
    before = {n: m.rank for n, m in adapters(model)}
    trainer.train()
    opt = getattr(trainer.optimizer, "optimizer", trainer.optimizer)  # (accelerate's wrapper)
    assert isinstance(opt, rankwise.SDLRT)
    assert {n: m.rank for n, m in adapters(model)} != before  # the integrator ran inside optimizer.step
    logged = [e for e in trainer.state.log_history if "adapter_rank_total" in e]
    assert logged and all(f"adapter_rank/{n}" in logged[-1] for n in before)
    assert 0 <= logged[-1]["adapter_tau_mean"] <= 0.05
    assert any(layer.S.abs().sum() > 0 for _, layer in adapters(model))


def test_trainer_clips_what_the_integrator_reads(tmp_path):
    """max_grad_norm reaches the factor gradients: at 1e-12 the adapters barely move (Adam's
    steps shrink to ~lr·1e-4), at 0 (off) they move."""
    from rankwise.peft import RankwiseTrainer

    moved = {}
    for norm in (0.0, 1e-12):
        model = get_adapter_model(tiny_bert(), AdapterConfig(QKV, r=4, tau=0.05))
        ids, y = batch(0, n=16)
        data = [{"input_ids": ids[i], "labels": y[i]} for i in range(len(y))]
        args = transformers.TrainingArguments(output_dir=str(tmp_path / f"out{norm}"), max_steps=4,
                                              learning_rate=0.02, per_device_train_batch_size=8, report_to=[],
                                              save_strategy="no", use_cpu=True, disable_tqdm=True,
                                              max_grad_norm=norm)
        RankwiseTrainer(model=model, args=args, train_dataset=data).train()
        moved[norm] = max(float((layer.U @ layer.S @ layer.V.T).detach().abs().max())
                          for _, layer in adapters(model))
    assert moved[0.0] > 1e-3 and moved[1e-12] < 1e-3 * moved[0.0]


def _saved(tmp_path, **cfg):
    from safetensors.torch import load_file

    model = get_adapter_model(tiny_bert(), AdapterConfig(QKV, r=4, tau=0.05, modules_to_save=["classifier"],
                                                         **cfg))
    save_adapter(model, tmp_path / "a")
    return model, tmp_path / "a", load_file(str(tmp_path / "a" / "adapter_model.safetensors"))


def _refused(directory, match):
    """load_adapter refuses with `match`, and the target model is left as it was."""
    fresh = get_adapter_model(tiny_bert(1), AdapterConfig(QKV, r=4, tau=0.05, max_rank=8,
                                                          modules_to_save=["classifier"]))
    before = {k: v.clone() for k, v in fresh.state_dict().items()}
    with pytest.raises(ValueError, match=match):
        load_adapter(fresh, directory)
    after = fresh.state_dict()
    assert before.keys() == after.keys() and all(torch.equal(before[k], after[k]) for k in before)


def test_load_adapter_refuses_tensors_it_does_not_own(tmp_path):
    from safetensors.torch import save_file

    model, d, state = _saved(tmp_path)
    base = next(n for n, _ in model.named_parameters() if n.endswith("query.base.weight"))
    state[base] = torch.zeros_like(dict(model.named_parameters())[base])  # a frozen base weight
    state["bert.embeddings.word_embeddings.weight"] = torch.zeros(50, 32)
    save_file(state, str(d / "adapter_model.safetensors"))
    _refused(d, r"does not own: .*query\.base\.weight")


def test_load_adapter_checks_every_factor_shape_and_missing_keys(tmp_path):
    from safetensors.torch import save_file

    model, d, state = _saved(tmp_path)
    name = next(n for n, _ in adapters(model))
    big = dict(state)
    big |= {f"{name}.U": torch.zeros(32, 40), f"{name}.S": torch.zeros(40, 40),
            f"{name}.V": torch.zeros(32, 40)}
    meta = json.loads((d / "adapter_config.json").read_text())
    meta["ranks"][name] = 40
    (d / "adapter_config.json").write_text(json.dumps(meta))
    save_file(big, str(d / "adapter_model.safetensors"))
    _refused(d, rf"{name}.* rank 40, outside \[1, 8\]")
    meta["ranks"][name] = 4
    (d / "adapter_config.json").write_text(json.dumps(meta))
    bad = dict(state)
    bad[f"{name}.S"] = torch.zeros(4, 3)
    save_file(bad, str(d / "adapter_model.safetensors"))
    _refused(d, r"wrong shape .*\.S \(4, 3\) vs \(4, 4\)")
    gone = {k: v for k, v in state.items() if not k.startswith("classifier.")}
    save_file(gone, str(d / "adapter_model.safetensors"))
    _refused(d, r"lacks 'classifier\.")


def test_load_adapter_bounds_and_names_its_config_file(tmp_path):
    _, d, _ = _saved(tmp_path)
    cfg = d / "adapter_config.json"
    good = cfg.read_text()
    cfg.write_text(good[:-20])
    _refused(d, r"adapter_config\.json is not valid JSON")
    with open(cfg, "wb") as f:  # sparse: 2 MiB of nothing, never read
        f.truncate(2 << 20)
    _refused(d, r"adapter_config\.json is 2,097,152 bytes")
    cfg.write_text(good)
    (d / "adapter_model.safetensors").write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{not json")
    _refused(d, "not a readable safetensors file")
