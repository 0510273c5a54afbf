"""to_low_rank / export / compression on real architectures: torch's transformer layers and
attention (fast path, masks, dropout, export), Hugging Face GPT-2's Conv1D, tied weights,
modules registered under two names, the meta device, and a model's parameters passed instead
of the model. Each low-rank model at full rank is checked against the dense model it came from."""

from __future__ import annotations

import copy
import subprocess
import sys
import warnings

import pytest
import torch
from torch import nn

from rankwise.nn import (
    LowRankConv1D,
    LowRankLinear,
    LowRankMultiheadAttention,
    compression,
    export,
    to_low_rank,
)
from rankwise.optim import DLRT

pytestmark = pytest.mark.usefixtures("one_thread")  # tiny SVDs: threads only wait on each other
FULL = 10_000  # a rank above every layer's: the truncation keeps everything
TOL = dict(atol=1e-5, rtol=1e-5)


def n_params(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


def no_warnings(fn, *args, **kw):
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        return fn(*args, **kw)


@pytest.fixture
def transformers():
    tf = pytest.importorskip("transformers")  # the rankwise[peft] extra; make test installs it
    tf.logging.set_verbosity_error()
    return tf


def gpt2(transformers):
    cfg = transformers.GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=64, n_positions=32,
                                  bos_token_id=0, eos_token_id=0)
    return transformers.GPT2LMHeadModel(cfg).eval()


def llama(transformers):
    cfg = transformers.LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                   num_attention_heads=2, num_key_value_heads=2, vocab_size=64,
                                   max_position_embeddings=32, tie_word_embeddings=True,
                                   bos_token_id=0, eos_token_id=0, pad_token_id=0)
    return transformers.LlamaForCausalLM(cfg).eval()


# ----------------------------------------------------------------------------- item 3: encoder fast path
def test_encoder_layer_fast_path_and_export_compute_the_slow_path_function(monkeypatch):
    """eval + no_grad + batch_first takes torch's fused encoder kernel where it can, which reads
    the layers' ``weight`` (and the attention's ``in_proj_weight``). The low-rank model's dense
    views are write-protected tensor subclasses, which torch's check sends to the slow path; the
    exported copy (factorised linears inside the encoder are stored dense) takes the fused
    kernel. Both give the slow path's output."""
    layer = nn.TransformerEncoderLayer(d_model=16, nhead=2, dim_feedforward=32, batch_first=True)
    model = to_low_rank(layer, rank=4).eval()
    calls = []
    fused = torch._transformer_encoder_layer_fwd
    monkeypatch.setattr(torch, "_transformer_encoder_layer_fwd", lambda *a: calls.append(1) or fused(*a))
    x = torch.randn(3, 5, 16)
    plain = export(model)  # merge="auto": linear1/linear2 would be factorised, but the encoder reads them
    with torch.no_grad():
        torch.backends.mha.set_fastpath_enabled(False)
        try:
            slow, plain_slow = model(x), plain(x)
        finally:
            torch.backends.mha.set_fastpath_enabled(True)
        fast = model(x)
        assert not calls  # the low-rank model: torch's slow path
        plain_fast = plain(x)
    assert len(calls) == 1  # the export: the fused kernel
    for y in (fast, plain_slow, plain_fast):
        torch.testing.assert_close(y, slow, **TOL)
    assert type(plain.linear1) is nn.Linear and type(plain.self_attn) is nn.MultiheadAttention


@pytest.mark.filterwarnings("ignore:The PyTorch API of nested tensors")
def test_encoder_stack_nested_fast_path_with_padding_matches():
    """nn.TransformerEncoder with a padding mask in eval/no_grad packs the batch into a nested
    tensor and runs the fused kernel on it: same output at the unpadded positions."""
    enc = nn.TransformerEncoder(nn.TransformerEncoderLayer(16, 2, 32, batch_first=True), 2,
                                enable_nested_tensor=True)
    model = to_low_rank(enc, rank=4).eval()
    x, pad = torch.randn(2, 6, 16), torch.tensor([[False] * 6, [False] * 4 + [True] * 2])
    with torch.no_grad():
        fast = model(x, src_key_padding_mask=pad)
        torch.backends.mha.set_fastpath_enabled(False)
        try:
            slow = model(x, src_key_padding_mask=pad)
        finally:
            torch.backends.mha.set_fastpath_enabled(True)
    keep = ~pad
    torch.testing.assert_close(fast[keep], slow[keep], **TOL)


def test_export_never_warns_for_layers_stored_dense():
    model = to_low_rank(nn.TransformerEncoderLayer(16, 2, 32, batch_first=True), rank=2)
    with pytest.warns(UserWarning, match=r"merge='never'.*'linear1', 'linear2'"):
        plain = export(model, merge="never")
    assert type(plain.linear1) is nn.Linear


# ----------------------------------------------------------------------------- item 5: attention
def _pair(batch_first: bool, **kw):
    dense = nn.MultiheadAttention(16, 4, batch_first=batch_first, **kw)
    return dense, to_low_rank(nn.Sequential(copy.deepcopy(dense)), rank=FULL)[0]


CASES = {
    "plain": {},
    "bool mask": {"attn_mask": torch.rand(5, 7) > 0.7},
    "float mask, per head": {"attn_mask": torch.randn(2 * 4, 5, 7)},
    "padding": {"key_padding_mask": torch.tensor([[False] * 7, [False] * 5 + [True] * 2])},
    "padding and mask": {"key_padding_mask": torch.tensor([[False] * 6 + [True], [False] * 7]),
                         "attn_mask": torch.rand(5, 7) > 0.8},
    "per-head weights": {"average_attn_weights": False},
    "no weights": {"need_weights": False},
}


@pytest.mark.parametrize("batch_first", [False, True])
@pytest.mark.parametrize("case", list(CASES))
def test_attention_matches_torch(batch_first, case):
    dense, low = _pair(batch_first)
    assert isinstance(low, LowRankMultiheadAttention) and isinstance(low, nn.MultiheadAttention)
    assert all(type(m) is LowRankLinear for m in low.projections().values())
    q, kv = torch.randn(5, 2, 16), torch.randn(7, 2, 16)
    if batch_first:
        q, kv = q.transpose(0, 1), kv.transpose(0, 1)
    for training in (False, True):  # train: dropout 0 here, but the same code path
        dense.train(training), low.train(training)
        (y, w), (y2, w2) = dense(q, kv, kv, **CASES[case]), low(q, kv, kv, **CASES[case])
        torch.testing.assert_close(y2, y, **TOL)
        assert (w is None) == (w2 is None)
        if w is not None:
            torch.testing.assert_close(w2, w, **TOL)


def test_attention_causal_unbatched_separate_dims_and_dropout():
    causal = nn.Transformer.generate_square_subsequent_mask(5)
    dense, low = _pair(True)
    x = torch.randn(2, 5, 16)
    for need in (False, True):
        torch.testing.assert_close(low(x, x, x, attn_mask=causal, is_causal=True, need_weights=need)[0],
                                   dense(x, x, x, attn_mask=causal, is_causal=True, need_weights=need)[0],
                                   **TOL)
    with pytest.raises(RuntimeError, match="Need attn_mask"):
        low(x, x, x, is_causal=True)
    torch.testing.assert_close(low(x[0], x[0], x[0])[0], dense(x[0], x[0], x[0])[0], **TOL)  # unbatched
    dense, low = _pair(False, kdim=8, vdim=12)
    q, k, v = torch.randn(5, 2, 16), torch.randn(7, 2, 8), torch.randn(7, 2, 12)
    assert low.in_proj_weight is None and low.k_proj_weight.shape == (16, 8)
    torch.testing.assert_close(low(q, k, v)[0], dense(q, k, v)[0], **TOL)
    dense, low = _pair(True, dropout=0.3)  # train mode: the same dropout draws as torch's
    for need in (False, True):
        torch.manual_seed(1)
        y = dense(x, x, x, need_weights=need)[0]
        torch.manual_seed(1)
        torch.testing.assert_close(low(x, x, x, need_weights=need)[0], y, **TOL)


def test_attention_options_without_a_low_rank_form_are_refused_by_name():
    model = nn.Sequential(nn.MultiheadAttention(8, 2, add_bias_kv=True), nn.Linear(8, 8))
    with pytest.warns(UserWarning, match=r"leaving '0' dense: .*add_bias_kv=True"):
        to_low_rank(model, rank=2)
    assert type(model[0]) is nn.MultiheadAttention and isinstance(model[1], LowRankLinear)
    with pytest.raises(ValueError, match=r"converted nothing.*'0'.*add_zero_attn=True"):
        to_low_rank(nn.Sequential(nn.MultiheadAttention(8, 2, add_zero_attn=True)), rank=2)
    with pytest.raises(ValueError, match="add_bias_kv"):
        LowRankMultiheadAttention.from_dense(nn.MultiheadAttention(8, 2, add_bias_kv=True), rank=2)


@pytest.mark.parametrize("kind", ["encoder", "decoder"])
def test_attention_inside_transformer_layers_train_eval_and_export(kind):
    """Full rank: the converted layer is the dense one in train mode (same dropout draws) and in
    eval; export gives a torch nn.MultiheadAttention computing the same."""
    if kind == "encoder":
        dense = nn.TransformerEncoderLayer(16, 2, 32, dropout=0.2, batch_first=True)
        args = (torch.randn(2, 5, 16),)
    else:
        dense = nn.TransformerDecoderLayer(16, 2, 32, dropout=0.2, batch_first=False)
        args = (torch.randn(5, 2, 16), torch.randn(7, 2, 16))
    low = to_low_rank(copy.deepcopy(dense), rank=FULL)
    assert type(low.self_attn) is LowRankMultiheadAttention
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # (the encoder's linear1/linear2 are stored dense)
        plain = export(low, merge="never")
    assert type(plain.self_attn) is nn.MultiheadAttention
    assert type(plain.linear1) is (nn.Linear if kind == "encoder" else nn.Sequential)
    pad = torch.tensor([[False] * 5, [False] * 3 + [True] * 2])
    mask = {"tgt_mask": nn.Transformer.generate_square_subsequent_mask(5), "tgt_is_causal": True} \
        if kind == "decoder" else {"src_key_padding_mask": pad}
    for training in (True, False):
        outs = []
        for m in (dense, low, plain):
            torch.manual_seed(3)
            outs.append(m.train(training)(*args, **mask))
        torch.testing.assert_close(outs[1], outs[0], **TOL)
        torch.testing.assert_close(outs[2], outs[0], **TOL)


def test_dlrt_trains_the_attention_projections():
    model = to_low_rank(nn.TransformerEncoderLayer(16, 2, 32, dropout=0.0, batch_first=True), rank=3)
    opt = DLRT(model, 0.05, tau=0.1)
    assert {f"self_attn.{p}" for p in ("q_proj", "k_proj", "v_proj", "out_proj")} <= set(opt.layers)
    x = torch.randn(4, 5, 16)
    before = model.self_attn.q_proj.weight.detach().clone()

    def closure():
        opt.zero_grad()
        loss = model(x).square().mean()
        loss.backward()
        return loss

    opt.step(closure)
    assert not torch.equal(model.self_attn.q_proj.weight, before)


def test_attention_ranks_by_mapping_and_by_target():
    def model():
        return nn.Sequential(nn.MultiheadAttention(16, 2), nn.Linear(16, 16))

    m = to_low_rank(model(), rank={"0.q_proj": 2, "0.k_proj": 3, "0.v_proj": 4, "0.out_proj": 5, "1": 6})
    assert m[0].ranks == {"q_proj": 2, "k_proj": 3, "v_proj": 4, "out_proj": 5} and m[1].rank == 6
    assert to_low_rank(model(), rank={"0": 3})[0].ranks == dict.fromkeys(m[0].ranks, 3)
    with pytest.raises(ValueError, match=r"'0'.*not \['0.v_proj', '0.out_proj'\]"):
        to_low_rank(model(), rank={"0.q_proj": 2, "0.k_proj": 3})
    m = to_low_rank(model(), target=0.5)
    assert isinstance(m[0], LowRankMultiheadAttention)
    assert compression(m)["ratio"] == pytest.approx(0.5, abs=0.05)


# ----------------------------------------------------------------------------- item 4: GPT-2 Conv1D
def test_gpt2_conv1d_projections_are_converted_and_exported(transformers):
    model = gpt2(transformers)
    conv1d = transformers.pytorch_utils.Conv1D
    names = [n for n, m in model.named_modules() if type(m) is conv1d]
    assert len(names) == 8
    x = torch.randint(0, 64, (2, 7))
    ref = model(x).logits
    weights = {n: model.get_submodule(n).weight.detach().clone() for n in names}
    with pytest.warns(UserWarning, match="tied"):
        to_low_rank(model, rank=FULL)
    for n in names:
        layer = model.get_submodule(n)
        assert type(layer) is LowRankConv1D and (layer.nx, layer.nf) == weights[n].shape
        torch.testing.assert_close(layer.weight, weights[n], **TOL)  # (in, out), as Conv1D
    torch.testing.assert_close(model(x).logits, ref, **TOL)
    merged, factored = export(model, merge="always"), export(model, merge="never")
    assert type(merged.get_submodule(names[0])) is conv1d
    assert type(factored.get_submodule(names[0])) is nn.Sequential
    for plain in (merged, factored):
        torch.testing.assert_close(plain(x).logits, ref, **TOL)


def test_converting_a_plain_model_never_imports_transformers():
    code = ("import sys, torch, rankwise\n"
            "nn = torch.nn\n"
            "m = rankwise.to_low_rank(nn.Sequential(nn.Linear(8, 8), nn.MultiheadAttention(8, 2)), rank=2)\n"
            "rankwise.export(m, merge='always'); rankwise.compression(m)\n"
            "assert 'transformers' not in sys.modules")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)


# ----------------------------------------------------------------------------- items 6, 8: tied weights
def test_tied_linears_stay_tied_with_one_warning_and_compression_counts_once():
    model = nn.Sequential()
    model.enc, model.mid, model.dec = nn.Linear(16, 16), nn.Linear(16, 16), nn.Linear(16, 16)
    model.dec.weight = model.enc.weight
    before = n_params(model)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        to_low_rank(model, rank=2)
    assert len(caught) == 1 and "'enc'" in str(caught[0].message) and "'dec'" in str(caught[0].message)
    assert model.dec.weight is model.enc.weight and isinstance(model.mid, LowRankLinear)
    c = compression(model)
    assert c["dense_params"] == before and c["stored_params"] == n_params(model) < before
    tied_only = nn.Sequential(nn.Linear(16, 16), nn.Linear(16, 16))
    tied_only[1].weight = tied_only[0].weight
    with pytest.raises(ValueError, match=r"converted nothing.*tied"):
        to_low_rank(tied_only, rank=2)
    with pytest.raises(ValueError, match="tied"):
        to_low_rank(tied_only, rank={"1": 2})


@pytest.mark.parametrize("make", [gpt2, llama])
def test_hf_lm_head_stays_tied_to_the_embedding(make, transformers):
    model = make(transformers)
    before, x = n_params(model), torch.randint(0, 64, (2, 7))
    with pytest.warns(UserWarning, match="'lm_head' \\(shares '.*(wte|embed_tokens).weight'\\)"):
        to_low_rank(model, rank=4)
    head, emb = model.get_output_embeddings(), model.get_input_embeddings()
    assert type(head) is nn.Linear and head.weight is emb.weight
    model.tie_weights()  # HF's own re-tie finds a plain Linear
    assert head.weight is emb.weight
    c = compression(model)
    assert c["dense_params"] == before and c["stored_params"] == n_params(model) < before
    plain = export(model)
    assert plain.get_output_embeddings().weight is plain.get_input_embeddings().weight
    torch.testing.assert_close(plain(x).logits, model(x).logits, **TOL)


# ----------------------------------------------------------------------------- items 7, 8: shared modules
def test_a_module_under_two_names_becomes_one_shared_low_rank_layer():
    lin = nn.Linear(8, 8)
    model = nn.Module()
    model.a, model.b = lin, lin
    model.seq = nn.Sequential(lin, nn.Linear(8, 8))
    to_low_rank(model, rank=2)
    assert isinstance(model.a, LowRankLinear) and model.b is model.a and model.seq[0] is model.a
    c = compression(model)  # the shared layer once: U, S, V + bias, and the other layer
    assert c["stored_params"] == n_params(model) == 2 * (8 * 2 + 4 + 8 * 2 + 8)
    assert c["dense_params"] == 2 * (64 + 8)
    m2 = nn.Module()
    m2.a = m2.b = nn.Linear(8, 8)
    m2.c = nn.Linear(8, 8)
    to_low_rank(m2, rank=2, exclude=["b"])  # excluded under one of its names: left dense
    assert type(m2.a) is nn.Linear and m2.a is m2.b and isinstance(m2.c, LowRankLinear)


# ----------------------------------------------------------------------------- item 17: parameters
@pytest.mark.parametrize("fn", [to_low_rank, compression, export])
def test_parameters_instead_of_the_model_are_refused_in_one_line(fn):
    model = nn.Linear(4, 4)
    with pytest.raises(TypeError, match=r"takes the model \(an nn.Module\), not its parameters") as e:
        fn(model.parameters(), rank=2) if fn is to_low_rank else fn(model.parameters())
    assert "\n" not in str(e.value)


# ----------------------------------------------------------------------------- item 23: meta device
def _meta_model() -> nn.Module:
    return nn.Sequential(nn.Conv2d(3, 8, 3), nn.Flatten(), nn.Linear(8 * 4 * 4, 16),
                         nn.Unflatten(1, (2, 8)), nn.MultiheadAttention(8, 2, batch_first=True))


def test_meta_model_converts_at_a_given_rank_without_values():
    with torch.device("meta"):
        model = _meta_model()
    no_warnings(to_low_rank, model, rank=3, max_rank=5)
    layers = [model[0], model[2], *model[4].projections().values()]
    assert all(m.U.is_meta and m.rank == 3 and m.max_rank == 5 for m in layers)
    for kw in ({"tau": 0.1}, {"rank": 2, "tau": 0.1}, {"target": 0.5}):
        with torch.device("meta"):
            fresh = _meta_model()
        with pytest.raises(ValueError, match=r"meta device.*`tau` and `target` need"):
            to_low_rank(fresh, **kw)
    # materialise and load a real low-rank model's weights: the same function
    real = to_low_rank(_meta_model(), rank=3).eval()
    model.to_empty(device="cpu").load_state_dict(real.state_dict())

    class Run(nn.Module):
        def forward(self, m, x):
            h = m[3](m[2](m[1](m[0](x))))
            return m[4](h, h, h)[0]

    x = torch.randn(2, 3, 6, 6)
    torch.testing.assert_close(Run()(model.eval(), x), Run()(real, x))


def test_meta_gpt2_converts_at_rank(transformers):
    with torch.device("meta"):
        model = gpt2(transformers)
    with pytest.warns(UserWarning, match="tied"):
        to_low_rank(model, rank=4)
    c_attn = model.transformer.h[0].attn.c_attn
    assert type(c_attn) is LowRankConv1D and c_attn.U.is_meta and c_attn.rank == 4


# ----------------------------------------------------------------------------- the new modules' plumbing
def test_stability_distance_pairs_conv1d_and_attention_with_their_dense_shadows(transformers):
    from rankwise.nn import stability_distance

    for dense in (gpt2(transformers), nn.Sequential(nn.MultiheadAttention(16, 2), nn.Linear(16, 8))):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # GPT-2's tied lm_head
            low = to_low_rank(copy.deepcopy(dense), rank=3)
        assert stability_distance(low, dense) < 1e-4  # each layer is its shadow's truncated SVD


def test_low_rank_attention_pickles_and_loads_a_state_dict_of_other_ranks(tmp_path):
    src = to_low_rank(nn.Sequential(nn.MultiheadAttention(16, 2, batch_first=True)),
                      rank={"0.q_proj": 2, "0.k_proj": 3, "0.v_proj": 4, "0.out_proj": 5})
    torch.save(src, tmp_path / "m.pt")
    again = torch.load(tmp_path / "m.pt", weights_only=False)
    fresh = nn.Sequential(LowRankMultiheadAttention(16, 2, 1, batch_first=True))
    fresh.load_state_dict(src.state_dict())
    x = torch.randn(2, 5, 16)
    for m in (again, fresh, copy.deepcopy(src)):
        assert m[0].ranks == src[0].ranks
        torch.testing.assert_close(m[0](x, x, x)[0], src[0](x, x, x)[0])
