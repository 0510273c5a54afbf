"""save_pretrained / from_pretrained of converted Hugging Face models (GPT-2, Llama, BERT from
tiny configs): the merged export reloads with HF's own loader, and
rankwise.nn.from_pretrained restores the low-rank model, at its per-layer ranks."""

from __future__ import annotations

import warnings

import pytest
import torch

from rankwise.nn import AbstractLowRankLayer, export, from_pretrained, to_low_rank

transformers = pytest.importorskip("transformers")  # the rankwise[peft] extra; make test installs it
transformers.logging.set_verbosity_error()
transformers.utils.logging.disable_progress_bar()
pytestmark = pytest.mark.usefixtures("one_thread")  # tiny SVDs: threads only wait on each other
TOL = dict(atol=1e-5, rtol=1e-5)


def gpt2():
    cfg = transformers.GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=64, n_positions=32,
                                  bos_token_id=0, eos_token_id=0)
    return transformers.GPT2LMHeadModel(cfg), transformers.GPT2LMHeadModel


def llama():
    cfg = transformers.LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                   num_attention_heads=2, num_key_value_heads=2, vocab_size=64,
                                   max_position_embeddings=32, tie_word_embeddings=True,
                                   bos_token_id=0, eos_token_id=0, pad_token_id=0)
    return transformers.LlamaForCausalLM(cfg), transformers.AutoModelForCausalLM


def bert():
    cfg = transformers.BertConfig(vocab_size=64, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                                  intermediate_size=64, max_position_embeddings=32, num_labels=3)
    return transformers.BertForSequenceClassification(cfg), transformers.BertForSequenceClassification


MODELS = {"gpt2": gpt2, "llama": llama, "bert": bert}


def converted(name: str):
    """A model converted by tolerance (so its layers have different ranks), its loader class, and
    its eval-mode outputs on a fixed input."""
    model, cls = MODELS[name]()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the tied lm_head left dense
        to_low_rank(model.eval(), tau=0.3)
    if name == "gpt2":  # every Conv1D projection is low-rank (so the merged export must give Conv1D)
        assert not any(type(m).__name__ == "Conv1D" for m in model.modules())
    x = torch.randint(0, 64, (2, 7))
    return model, cls, x, model(x).logits


def ranks(model) -> dict[str, int]:
    return {n: m.rank for n, m in model.named_modules() if isinstance(m, AbstractLowRankLayer)}


@pytest.mark.parametrize("name", list(MODELS))
def test_merged_export_reloads_with_hf_from_pretrained(name, tmp_path):
    model, cls, x, y = converted(name)
    export(model, merge="always").save_pretrained(tmp_path)
    again = cls.from_pretrained(tmp_path)
    assert not any(isinstance(m, AbstractLowRankLayer) for m in again.modules())
    torch.testing.assert_close(again(x).logits, y, **TOL)


@pytest.mark.parametrize("name", list(MODELS))
def test_from_pretrained_restores_the_low_rank_model(name, tmp_path):
    model, cls, x, y = converted(name)
    assert len(set(ranks(model).values())) > 1  # per-layer ranks, read back from the saved factors
    model.save_pretrained(tmp_path)
    again = from_pretrained(cls, tmp_path)
    assert type(again) is type(model) and not again.training
    assert ranks(again) == ranks(model)
    torch.testing.assert_close(again(x).logits, y, rtol=0, atol=0)
    head, emb = again.get_output_embeddings(), again.get_input_embeddings()
    if name != "bert":
        assert head.weight is emb.weight  # the tie saved once is restored


def test_from_pretrained_refuses_a_dense_folder_and_hf_loses_the_factors(tmp_path):
    model, cls = gpt2()
    model.save_pretrained(tmp_path / "dense")
    with pytest.raises(ValueError, match=r"no low-rank factors.*GPT2LMHeadModel\.from_pretrained"):
        from_pretrained(cls, tmp_path / "dense")
    low, cls, x, y = converted("gpt2")
    low.save_pretrained(tmp_path / "low")
    # why the loader exists: HF's own loader rebuilds the dense architecture, factors unused
    hf = cls.from_pretrained(tmp_path / "low")
    assert not torch.allclose(hf(x).logits, y, atol=1e-3)
