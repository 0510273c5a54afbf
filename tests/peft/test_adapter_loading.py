"""load_adapter refuses what would change the frozen model or non-finite factors, and leaves the
model as it was when it refuses or fails (issue 49)."""

from __future__ import annotations

import pytest


def _adapter_case(tmp_path, save_modules):
    from test_peft import QKV, tiny_bert

    from rankwise.peft import AdapterConfig, get_adapter_model, save_adapter

    model = get_adapter_model(tiny_bert(), AdapterConfig(QKV, r=4, tau=0.05, modules_to_save=save_modules))
    save_adapter(model, tmp_path / "a")
    fresh = get_adapter_model(tiny_bert(1), AdapterConfig(QKV, r=4, tau=0.05, modules_to_save=save_modules))
    return tmp_path / "a", fresh


def _unchanged_after_refusal(fresh, directory, match):
    import torch

    from rankwise.peft import load_adapter

    before = {k: v.clone() for k, v in fresh.state_dict().items()}
    with pytest.raises(ValueError, match=match):
        load_adapter(fresh, directory)
    after = fresh.state_dict()
    assert before.keys() == after.keys() and all(torch.equal(before[k], after[k]) for k in before)


def test_load_adapter_refuses_a_config_that_saves_the_base_or_a_block(tmp_path):
    """The adapter's own config added `base` to modules_to_save and shipped query.base.weight:
    it replaced the frozen W0; with modules_to_save ["layer"] (holding adapters) it changed S and
    the base weights, then raised."""
    import json

    from safetensors.torch import load_file, save_file

    d, fresh = _adapter_case(tmp_path, ["classifier"])
    cfg = json.loads((d / "adapter_config.json").read_text())
    cfg["config"]["modules_to_save"] = ["classifier", "base"]
    (d / "adapter_config.json").write_text(json.dumps(cfg))
    state = load_file(str(d / "adapter_model.safetensors"))
    W0 = fresh.get_submodule("bert.encoder.layer.0.attention.self.query.base").weight
    state["bert.encoder.layer.0.attention.self.query.base.weight"] = W0.detach() + 1
    save_file(state, str(d / "adapter_model.safetensors"))
    _unchanged_after_refusal(fresh, d, "modules_to_save .* differ from the model's")
    d2, block = _adapter_case(tmp_path / "b", ["layer"])
    _unchanged_after_refusal(block, d2, "is, holds or lies inside the adapted layer")


def test_load_adapter_refuses_non_finite_factors_by_name(tmp_path):
    import torch
    from safetensors.torch import load_file, save_file

    d, fresh = _adapter_case(tmp_path, ["classifier"])
    state = load_file(str(d / "adapter_model.safetensors"))
    key = next(k for k in state if k.endswith(".S"))
    state[key] = state[key].clone()
    state[key][0, 0] = torch.nan
    save_file(state, str(d / "adapter_model.safetensors"))
    _unchanged_after_refusal(fresh, d, f"non-finite values .*{key}")


def test_load_adapter_puts_the_model_back_when_applying_fails(tmp_path, monkeypatch):
    """A failure after the checks (here: raised once everything was written) restores the
    factors and the saved modules as they were."""
    from rankwise.peft import _model, load_adapter

    d, fresh = _adapter_case(tmp_path, ["classifier"])
    apply = _model._apply

    def fails_after_writing(model, layers, state):
        apply(model, layers, state)
        raise RuntimeError("disk gone")

    monkeypatch.setattr(_model, "_apply", fails_after_writing)
    import torch

    before = {k: v.clone() for k, v in fresh.state_dict().items()}
    with pytest.raises(RuntimeError, match="disk gone"):
        load_adapter(fresh, d)
    after = fresh.state_dict()
    assert before.keys() == after.keys() and all(torch.equal(before[k], after[k]) for k in before)
