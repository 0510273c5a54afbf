"""DenseEMA: an EMA of the dense weights that survives the integrator's rank changes (issue item 15)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import rankwise
from helpers import F64, mse_closure
from rankwise.nn import LowRankLinear
from rankwise.optim import DenseEMA


def _model() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(LowRankLinear(12, 16, 6, dtype=F64), nn.LayerNorm(16, dtype=F64), nn.Tanh(),
                         LowRankLinear(16, 3, 3, dtype=F64), nn.BatchNorm1d(3, dtype=F64))


def _dense(model: nn.Sequential) -> dict[str, torch.Tensor]:
    """The dense weights, formed here from the factors: an independent reference."""
    out = {}
    for name, p in model.named_parameters():
        layer, key = name.rsplit(".", 1)
        if key in "USV":
            m = model.get_submodule(layer)
            out[f"{layer}.weight"] = (m.U @ m.S @ m.V.T).detach().clone()
        else:
            out[name] = p.detach().clone()
    return out


def test_ema_follows_the_dense_weights_through_rank_changes():
    model, decay = _model(), 0.8
    ema = DenseEMA(model, decay)
    assert all(type(m).__module__.startswith("torch") for m in ema.module.modules())
    opt = rankwise.DLRT(model, 0.05, tau=0.3, optimizer="adam")
    X, Y = torch.randn(64, 12, dtype=F64), torch.randn(64, 3, dtype=F64)
    ranks, want = [], None
    for _ in range(8):
        opt.step(mse_closure(opt, model, X, Y))
        ema.update_parameters(model)
        ranks.append(tuple(opt.ranks().values()))
        now = _dense(model)
        want = now if want is None else {k: decay * want[k] + (1 - decay) * now[k] for k in now}
    assert len(set(ranks)) >= 3  # the ranks changed (several times) while the EMA ran
    got = dict(ema.module.named_parameters())
    assert set(got) == set(want)
    for k in want:
        torch.testing.assert_close(got[k], want[k], rtol=1e-12, atol=1e-12)
    assert int(ema.n_averaged) == 8
    torch.testing.assert_close(ema.module[4].running_mean, model[4].running_mean)  # buffers copied
    # the EMA module computes with the averaged dense weights
    model.eval(), ema.eval()
    x = torch.randn(5, 12, dtype=F64)
    h = torch.tanh(nn.functional.layer_norm(x @ want["0.weight"].T + want["0.bias"], (16,),
                                            want["1.weight"], want["1.bias"]))
    h = h @ want["3.weight"].T + want["3.bias"]
    ref = nn.functional.batch_norm(h, model[4].running_mean, model[4].running_var, want["4.weight"],
                                   want["4.bias"])
    torch.testing.assert_close(ema(x), ref, rtol=1e-10, atol=1e-10)


def test_first_update_copies_and_decay_one_holds():
    model = _model()
    ema = DenseEMA(model, decay=1.0)
    with torch.no_grad():
        model[0].S.mul_(2)
    ema.update(model)  # the first update copies, as AveragedModel's
    torch.testing.assert_close(ema.module[0].weight, _dense(model)["0.weight"])
    with torch.no_grad():
        model[0].S.mul_(2)
    ema.update(model)
    torch.testing.assert_close(ema.module[0].weight, (model[0].U @ (model[0].S / 2) @ model[0].V.T).detach())


@pytest.mark.parametrize("decay", [-0.1, 1.5, True, "0.9"])
def test_decay_outside_unit_interval_is_refused(decay):
    with pytest.raises(ValueError, match="`decay` must be a number in"):
        DenseEMA(_model(), decay)


def test_adapters_are_refused_in_one_line():
    transformers = pytest.importorskip("transformers")
    from rankwise.peft import AdapterConfig, get_adapter_model

    cfg = transformers.BertConfig(vocab_size=50, hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
                                  intermediate_size=32, max_position_embeddings=16)
    model = get_adapter_model(transformers.BertModel(cfg), AdapterConfig(["query"], r=2))
    with pytest.raises(TypeError, match="DenseEMA averages a dense copy"):
        DenseEMA(model)


def test_torch_averaged_model_fails_at_the_first_rank_change():
    """torch's AveragedModel averages the factors, whose shapes change with the rank: it raises
    there (documented; DenseEMA is the way that works)."""
    from torch.optim.swa_utils import AveragedModel, get_ema_multi_avg_fn

    model = _model()
    avg = AveragedModel(model, multi_avg_fn=get_ema_multi_avg_fn(0.9))
    opt = rankwise.DLRT(model, 0.05, tau=0.3, optimizer="adam")
    X, Y = torch.randn(64, 12, dtype=F64), torch.randn(64, 3, dtype=F64)
    with pytest.raises(RuntimeError):
        for _ in range(8):
            opt.step(mse_closure(opt, model, X, Y))
            avg.update_parameters(model)


def test_ema_of_a_converted_multihead_attention_and_gpt2():
    """Layers whose export renames their parameters (LowRankMultiheadAttention →
    nn.MultiheadAttention's in_proj_weight) are averaged through their dense export; GPT-2's
    Conv1D layers through their (in, out) dense weight."""
    pytest.importorskip("rankwise.nn._attention")

    class Attention(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.att = nn.MultiheadAttention(16, 2, batch_first=True, dtype=F64)

        def forward(self, x):
            return self.att(x, x, x)[0]

    model = rankwise.to_low_rank(Attention(), rank=4)
    ema = DenseEMA(model, 0.5)
    ema.update_parameters(model)
    first = ema.module.att.in_proj_weight.detach().clone()
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(1.5)
    ema.update_parameters(model)
    now = rankwise.export(model, merge="always").att.in_proj_weight
    torch.testing.assert_close(ema.module.att.in_proj_weight, 0.5 * first + 0.5 * now.detach())
    x = torch.randn(2, 5, 16, dtype=F64)
    assert now.shape == (48, 16) and ema(x).shape == (2, 5, 16)

    transformers = pytest.importorskip("transformers")
    cfg = transformers.GPT2Config(vocab_size=64, n_positions=16, n_embd=32, n_layer=1, n_head=2,
                                  tie_word_embeddings=False, bos_token_id=0, eos_token_id=0)
    gpt = rankwise.to_low_rank(transformers.GPT2LMHeadModel(cfg), rank=4).eval()
    ema = DenseEMA(gpt, 0.9).eval()
    ema.update_parameters(gpt)
    ids = torch.randint(0, 64, (2, 8))
    torch.testing.assert_close(ema(input_ids=ids).logits, gpt(input_ids=ids).logits, rtol=1e-4, atol=1e-4)
