"""from_pretrained: rebuild a low-rank Hugging Face model from its ``save_pretrained`` folder.

``save_pretrained`` of a converted model stores each low-rank layer's factors
(``<layer>.U`` (out, r), ``.S`` (r, r), ``.V`` (in, r), ``.bias``, SDLRT's ``.U_buf`` /
``.V_buf``) beside the config. HF's own ``from_pretrained`` builds the dense architecture, finds
none of those keys and leaves the layers randomly initialised (it only logs the missing keys):
a different model. :func:`from_pretrained` builds the same architecture, converts exactly the
saved layers at their saved ranks and loads every tensor.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from torch import Tensor, nn

from ._convert import to_low_rank

_FACTORS = ("U", "S", "V")


def from_pretrained(model_class, path: str | Path, *, dtype: torch.dtype | None = None,
                    max_rank: int | None = None) -> nn.Module:
    """The low-rank model that ``model.save_pretrained(path)`` stored, converted model included.

    The model is built from the saved config (``model_class(config)``, or
    ``model_class.from_config(config)`` for an ``AutoModel...`` class), every layer with saved
    factors is converted at its saved rank (``to_low_rank(model, rank={name: r})``, r = the saved
    ``S``'s size, so layers whose ranks training changed come back at those ranks), and the saved
    tensors are loaded strictly: each saved key must fit the model and each parameter must be
    loaded, except a tied weight that ``save_pretrained`` stored once (an ``lm_head`` tied to the
    embedding).

    **Arguments:**
    - `model_class`: the Hugging Face model class the model was (``GPT2LMHeadModel``,
      ``LlamaForCausalLM``, ``BertForSequenceClassification``) or an auto class
      (``AutoModelForCausalLM``).
    - `path`: the folder ``save_pretrained`` wrote (``model.safetensors`` or
      ``pytorch_model.bin``, sharded or not, and ``config.json``). Local only: nothing is
      downloaded.
    - `dtype`: the dtype to build in; default: that of the saved floating-point tensors.
    - `max_rank`: the layers' cap for later rank growth (it is not in the saved tensors;
      default min(out, in) per layer, as :func:`to_low_rank`).

    **Returns:** the model, in eval mode (as HF's ``from_pretrained``).

    **Raises:** ``FileNotFoundError`` without a weights file; ``ValueError`` when the folder holds
    no low-rank factors (load it with ``model_class.from_pretrained``), or when saved keys and
    the model's parameters do not match (naming them).
    """
    from transformers import AutoConfig

    path = Path(path)
    state = read_state_dict(path)
    ranks = saved_ranks(state)
    if not ranks:
        cls = getattr(model_class, "__name__", "the class")
        raise ValueError(f"{path} holds no low-rank factors (no '<layer>.U/.S/.V' keys): it is a dense "
                         f"model, load it with {cls}.from_pretrained")
    config = AutoConfig.from_pretrained(path, local_files_only=True)
    if isinstance(model_class, type) and issubclass(model_class, nn.Module):
        model = model_class(config)
    else:
        model = model_class.from_config(config)
    floating = [t.dtype for t in state.values() if t.is_floating_point()]
    model.to(dtype or (floating[0] if floating else torch.get_default_dtype()))
    to_low_rank(model, rank=ranks, max_rank=max_rank)
    _load_strictly(model, state, path)
    return model.eval()


def saved_ranks(state: dict[str, Tensor]) -> dict[str, int]:
    """``{layer name: rank}`` of the low-rank layers in a state dict (those with U, S and V)."""
    names = {k.rpartition(".")[0] for k in state if k.rpartition(".")[2] == "S"}
    return {n: state[f"{n}.S"].shape[0] for n in sorted(names)
            if all(f"{n}.{f}" in state for f in _FACTORS) and state[f"{n}.S"].dim() == 2}


def read_state_dict(path: Path) -> dict[str, Tensor]:
    """The tensors of a ``save_pretrained`` folder: safetensors or ``pytorch_model.bin``, sharded or not."""
    for name, load in (("model.safetensors", _load_safetensors), ("pytorch_model.bin", _load_bin)):
        if (path / name).is_file():
            return load(path / name)
        index = path / f"{name}.index.json"
        if index.is_file():
            shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
            return {k: v for shard in shards for k, v in load(path / shard).items()}
    raise FileNotFoundError(f"no model.safetensors or pytorch_model.bin (or a sharded index) in {path}")


def _load_safetensors(file: Path) -> dict[str, Tensor]:
    from safetensors.torch import load_file

    return load_file(str(file))


def _load_bin(file: Path) -> dict[str, Tensor]:
    return torch.load(file, map_location="cpu", weights_only=True)


def _load_strictly(model: nn.Module, state: dict[str, Tensor], path: Path) -> None:
    """``load_state_dict`` that tolerates only missing keys of tied parameters stored under another name."""
    missing, unexpected = model.load_state_dict(state, strict=False)
    stored = {id(p) for n, p in model.named_parameters(remove_duplicate=False) if n in state}
    params = dict(model.named_parameters(remove_duplicate=False))
    missing = [k for k in missing if k not in params or id(params[k]) not in stored]
    if missing or unexpected:
        raise ValueError(f"the tensors in {path} do not fit the rebuilt model: missing {missing[:8]}, "
                         f"unexpected {unexpected[:8]} (was it saved from this model class?)")
