"""Wrapping a model's Linear layers with adapters, and saving, loading, merging, exporting them."""

from __future__ import annotations

import copy
import json
from collections.abc import Iterator
from pathlib import Path

import torch
from torch import nn

from .._io import read_json, write_atomic
from ..nn._convert import set_submodule
from ._budget import budget_params, uniform_rank
from ._config import AdapterConfig
from ._layer import AdapterLinear

CONFIG_FILE = "adapter_config.json"  # AdapterConfig + the per-module ranks
WEIGHTS_FILE = "adapter_model.safetensors"  # U, S, V of every adapter and the modules_to_save


def adapters(model: nn.Module) -> Iterator[tuple[str, AdapterLinear]]:
    """(name, layer) of every :class:`AdapterLinear` in `model`."""
    return ((n, m) for n, m in model.named_modules() if isinstance(m, AdapterLinear))


def get_adapter_model(model: nn.Module, config: AdapterConfig) -> nn.Module:
    """Wrap every ``nn.Linear`` of `model` that `config.target_modules` names as frozen W0 plus a
    trainable U S Vᵀ adapter (:class:`AdapterLinear`), in place; freeze everything else except
    `config.modules_to_save`. Returns `model`, whose output is unchanged (the adapters start at
    a zero product). ``model.adapter_config`` holds `config`.

    With ``config.budget`` every adapter starts at the largest rank, the same for all (clamped
    to min(out, in) per layer), whose cost fits the budget (:class:`AdapterConfig`).

    Raises ``ValueError`` naming the model's Linear layers when no target matches, when the
    model already has adapters, and when the budget cannot hold every target at rank 1."""
    if not isinstance(config, AdapterConfig):
        raise TypeError(f"`config` must be a rankwise.peft.AdapterConfig; got {type(config).__name__}")
    if any(True for _ in adapters(model)):
        raise ValueError("`model` already has rankwise adapters; wrap the original model")
    linear = [n for n, m in model.named_modules() if type(m) is nn.Linear]
    targets = [n for n in linear if config.matches(n)]
    if not targets:
        shown = ", ".join(linear[:12]) + (f", … ({len(linear)} in all)" if len(linear) > 12 else "")
        raise ValueError(f"target_modules {config.target_modules!r} matches no nn.Linear of the model; "
                         f"its Linear layers are: {shown or 'none'}")
    saved = [n for n, _ in model.named_modules() if n and config.saves(n)]
    if config.modules_to_save and not saved:
        raise ValueError(f"modules_to_save {list(config.modules_to_save)} matches no module of the model")
    rank = config.r
    if config.budget is not None:
        shapes = [_shape(model.get_submodule(n)) for n in targets]
        rank = uniform_rank(shapes, budget_params(config.budget, shapes), buffer=config.method == "sdlrt")
        if config.max_rank is not None:
            rank = min(rank, config.max_rank)
    for p in model.parameters():
        p.requires_grad_(False)
    for name in targets:
        layer = AdapterLinear(model.get_submodule(name), rank, max_rank=config.max_rank,
                              alpha=config.alpha, dropout=config.dropout)
        set_submodule(model, name, layer)
    for name in saved:
        for p in model.get_submodule(name).parameters():
            p.requires_grad_(True)
    model.adapter_config = config
    return model


def _shape(layer: nn.Module) -> tuple[int, int]:
    return layer.out_features, layer.in_features


def adapter_budget(model: nn.Module) -> int | None:
    """The trainable parameters the adapters of `model` may hold (its ``AdapterConfig.budget``
    as a count: U, S, V of every adapter, SDLRT's buffer included); ``None`` without a budget."""
    config = _config_of(model)
    if config.budget is None:
        return None
    return budget_params(config.budget, [_shape(m) for _, m in adapters(model)])


def _config_of(model: nn.Module) -> AdapterConfig:
    config = getattr(model, "adapter_config", None)
    if not isinstance(config, AdapterConfig) or not any(True for _ in adapters(model)):
        raise ValueError("`model` has no rankwise adapters: wrap it with "
                         "rankwise.peft.get_adapter_model first")
    return config


def adapter_optimizer(model: nn.Module, lr: float, *, allocation: str = "error-sqrt",
                      **kwargs) -> torch.optim.Optimizer:
    """The integrator the model's :class:`AdapterConfig` asks for; `kwargs` go to it
    (``momentum``, ``optimizer="adam"``, ``update_every``, ``tau_min``, …).

    - Without a budget: ``rankwise.SDLRT`` (τ, ω) or ``rankwise.DLRT`` (τ).
    - With ``config.budget``: ``rankwise.AugmentedBUG`` with ``rankwise.Budget(params=B,
      ramp_steps=0, count_buffer=True, allocation=allocation)``, B = :func:`adapter_budget`,
      and SDLRT's buffer for ``method="sdlrt"`` (no τ feedback: the budget sets the ranks).
      The adapters' U, S, V (and buffer) then stay within B at every step, the ranks moving
      between modules; `min_rank` defaults to 1.

    Only what is trained is registered with the optimizer: the adapters' U, S, V and the
    parameters that require grad (the `modules_to_save`); the frozen base weights are not in
    its ``param_groups``, so its ``state_dict`` holds nothing of them.
    """
    from ..optim import DLRT, SDLRT, AugmentedBUG, Budget

    config = _config_of(model)
    if config.budget is not None:
        budget = Budget(params=adapter_budget(model), ramp_steps=0, allocation=allocation, count_buffer=True)
        kwargs.setdefault("min_rank", 1)
        return AugmentedBUG(model, lr, truncation=budget, buffer=config.method == "sdlrt", **kwargs)
    if allocation != "error-sqrt":
        raise ValueError(f"`allocation`={allocation!r} applies to adapters with a budget; this model's "
                         "AdapterConfig has budget=None")
    if config.method == "sdlrt":
        return SDLRT(model, lr, tau=config.tau, omega=config.omega, **kwargs)
    return DLRT(model, lr, tau=config.tau, **kwargs)


def _saved_state(model: nn.Module, config: AdapterConfig) -> dict[str, torch.Tensor]:
    state: dict[str, torch.Tensor] = {}
    for name, layer in adapters(model):
        for key in ("U", "S", "V"):
            state[f"{name}.{key}"] = getattr(layer, key).detach()
    for name, module in model.named_modules():
        if name and config.saves(name):
            for key, t in module.state_dict().items():
                state[f"{name}.{key}"] = t.detach()
    return {k: v.contiguous().cpu() for k, v in state.items()}


def save_adapter(model: nn.Module, directory: str | Path) -> Path:
    """Write the adapters (U, S, V of every adapted layer, at their current ranks) and the
    `modules_to_save` to ``directory/adapter_model.safetensors``, and the config with the
    per-module ranks to ``directory/adapter_config.json`` (both atomically). Returns the folder."""
    from safetensors.torch import save

    config = _config_of(model)
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    ranks = {name: layer.rank for name, layer in adapters(model)}
    write_atomic(directory / WEIGHTS_FILE, save(_saved_state(model, config)))
    meta = {"format": "rankwise-adapter", "version": 1, "config": config.to_dict(), "ranks": ranks}
    write_atomic(directory / CONFIG_FILE, (json.dumps(meta, indent=2) + "\n").encode())
    return directory


CONFIG_LIMIT = 1 << 20  # bytes: a config with every module's rank is a few KiB


def _read_meta(path: Path) -> dict:
    """The adapter config file, bounded in size and checked for the fields load_adapter reads."""
    try:
        meta = read_json(path, CONFIG_LIMIT)  # a regular file of at most CONFIG_LIMIT bytes, JSON
    except ValueError as e:
        raise ValueError(f"{e}: not a file written by save_adapter") from None
    if not isinstance(meta, dict) or meta.get("format") != "rankwise-adapter":
        raise ValueError(f"{path} is not a rankwise adapter config")
    ranks = meta.get("ranks")
    if not isinstance(ranks, dict) or not all(type(r) is int for r in ranks.values()):
        raise ValueError(f"{path}: `ranks` must map each adapted module to its rank (an int)")
    try:
        meta["config"] = AdapterConfig.from_dict(meta.get("config") or {})
    except (TypeError, ValueError) as e:
        raise ValueError(f"{path}: its `config` is not a valid AdapterConfig ({e})") from None
    return meta


def _listed(keys: set[str] | list[str], limit: int = 8) -> str:
    keys = sorted(keys)
    more = f" and {len(keys) - limit} more" if len(keys) > limit else ""
    return ", ".join(map(repr, keys[:limit])) + more


def load_adapter(model: nn.Module, directory: str | Path) -> nn.Module:
    """Load what :func:`save_adapter` wrote into `model`, a model wrapped by
    :func:`get_adapter_model` with the same targets; each adapter takes the saved rank (which
    may differ from the wrapped one).

    It loads exactly U, S and V of every adapter and the state of the model's own
    `modules_to_save` (the saved config must name the same ones), and nothing else: a key outside
    those (a frozen base weight, a module the config does not save), a missing key, a factor
    whose shape does not fit its layer (U (out, r), S (r, r), V (in, r) with 1 ≤ r ≤ the layer's
    `max_rank`), a non-finite value or a saved module's tensor of another shape is refused with a
    ``ValueError`` naming it, and so is a module to save that is, holds or lies inside an
    adapted layer (it would replace the frozen W0 or an adapter's factors). All of it is checked
    before the model is changed; should applying fail, the model is put back as it was.
    ``adapter_config.json`` is read only up to 1 MiB."""
    from safetensors import SafetensorError, safe_open

    mine = _config_of(model)
    directory = Path(directory)
    for f in (CONFIG_FILE, WEIGHTS_FILE):
        if not (directory / f).is_file():
            raise FileNotFoundError(f"{directory} has no {f}: not a folder written by save_adapter")
    meta = _read_meta(directory / CONFIG_FILE)
    ranks, saved_config = meta["ranks"], meta["config"]
    layers = dict(adapters(model))
    missing = sorted(set(ranks) ^ set(layers))
    if missing:
        raise ValueError(f"the saved adapters and the model's differ in {missing}: wrap the model with "
                         "the saved AdapterConfig")
    want: dict[str, tuple[int, ...]] = {}  # every key the file must hold, with its shape
    for name, layer in layers.items():
        r = ranks[name]
        if not 1 <= r <= layer.max_rank:
            raise ValueError(f"adapter {name!r} was saved at rank {r}, outside [1, {layer.max_rank}] (its "
                             f"max_rank for a {layer.out_features}×{layer.in_features} weight)")
        want |= {f"{name}.U": (layer.out_features, r), f"{name}.S": (r, r),
                 f"{name}.V": (layer.in_features, r)}
    if tuple(saved_config.modules_to_save or ()) != tuple(mine.modules_to_save or ()):
        raise ValueError(f"the saved adapter's modules_to_save {list(saved_config.modules_to_save or ())} "
                         f"differ from the model's {list(mine.modules_to_save or ())}: wrap the model with "
                         "the saved AdapterConfig")
    for name, module in model.named_modules():
        if not name or name in layers or not mine.saves(name):
            continue
        clash = [a for a in layers if a == name or a.startswith(name + ".") or name.startswith(a + ".")]
        if clash:
            raise ValueError(f"modules_to_save names {name!r}, which is, holds or lies inside the adapted "
                             f"layer(s) {_listed(set(clash))}: loading it would replace frozen or adapter "
                             "weights; save the adapters by themselves")
        want |= {f"{name}.{k}": tuple(t.shape) for k, t in module.state_dict().items()}
    path = directory / WEIGHTS_FILE
    try:
        with safe_open(str(path), framework="pt") as f:
            keys = set(f.keys())
            extra, absent = keys - set(want), set(want) - keys
            if extra:
                raise ValueError(f"{path} holds tensors this adapter does not own: {_listed(extra)} (only "
                                 "the adapters' U, S, V and the modules_to_save its config names load)")
            if absent:
                raise ValueError(f"{path} lacks {_listed(absent)}")
            shapes = {k: tuple(f.get_slice(k).get_shape()) for k in keys}
            wrong = {k: (shapes[k], want[k]) for k in keys if shapes[k] != want[k]}
            if wrong:
                raise ValueError(f"{path}: tensors of the wrong shape (saved, expected): "
                                 + "; ".join(f"{k} {a} vs {b}" for k, (a, b) in sorted(wrong.items())[:8]))
            state = {k: f.get_tensor(k) for k in keys}
    except SafetensorError as e:  # a damaged file
        raise ValueError(f"{path} is not a readable safetensors file ({e})") from None
    bad = sorted(k for k, t in state.items() if t.is_floating_point() and not bool(torch.isfinite(t).all()))
    if bad:
        raise ValueError(f"{path} holds non-finite values (NaN or inf) in {_listed(set(bad))}")
    # a copy of only what _apply writes (the factors and the saved modules; never the frozen base)
    factors = {name: [getattr(layer, k).detach().clone() for k in ("U", "S", "V", "U_buf", "V_buf")]
               for name, layer in layers.items()}
    modules = {m for m in (k.rpartition(".")[0] for k in state) if m not in layers}
    saved_before = {m: {k: t.clone() for k, t in model.get_submodule(m).state_dict().items()}
                    for m in modules}
    try:
        _apply(model, layers, state)
    except BaseException:
        with torch.no_grad():
            for name, layer in layers.items():
                layer.set_factors(*factors[name])
            for m, sd in saved_before.items():
                model.get_submodule(m).load_state_dict(sd)
        raise
    return model


def _apply(model: nn.Module, layers: dict, state: dict[str, torch.Tensor]) -> None:
    """Write checked adapter factors and saved modules' tensors into `model` (load_adapter)."""
    with torch.no_grad():
        for name, layer in layers.items():
            layer.set_factors(state.pop(f"{name}.U"), state.pop(f"{name}.S"), state.pop(f"{name}.V"),
                              layer.U_buf[:, :0], layer.V_buf[:, :0])
        saved: dict[str, dict[str, torch.Tensor]] = {}
        for key, t in state.items():
            module, _, tensor = key.rpartition(".")
            saved.setdefault(module, {})[tensor] = t
        for module, sd in saved.items():
            model.get_submodule(module).load_state_dict(sd)


def merge_and_unload(model: nn.Module) -> nn.Module:
    """Replace every adapter by a plain ``nn.Linear`` with weight W0 + alpha · U S Vᵀ (and W0's
    bias), in place; returns `model`, which then has no rankwise classes."""
    _config_of(model)
    with torch.no_grad():
        for name, layer in list(adapters(model)):
            base = layer.base
            base.weight.copy_(layer.dense_weight())
            set_submodule(model, name, base)
    del model.adapter_config
    return model


def export_peft_lora(model: nn.Module, directory: str | Path) -> Path:
    """Write the adapters as a stock PEFT LoRA adapter that ``peft.PeftModel.from_pretrained(base,
    directory)`` loads: ``lora_B = U S``, ``lora_A = Vᵀ`` per module, each module's rank in
    ``rank_pattern`` and ``lora_alpha = alpha · r`` in ``alpha_pattern`` (so PEFT's scaling
    alpha / r is exactly this adapter's alpha), and the trained `modules_to_save`. `base` is the
    model before :func:`get_adapter_model` (e.g. loaded again from its checkpoint)."""
    import peft

    config = _config_of(model)
    layers = dict(adapters(model))
    base = copy.deepcopy(model)
    for name in layers:
        set_submodule(base, name, base.get_submodule(name).base)
    del base.adapter_config
    ranks = {name: layer.rank for name, layer in layers.items()}
    top = max(ranks.values())
    lora = peft.LoraConfig(r=top, lora_alpha=config.alpha * top, target_modules=sorted(ranks),
                           lora_dropout=0.0, bias="none",
                           modules_to_save=list(config.modules_to_save) if config.modules_to_save else None,
                           rank_pattern=dict(ranks),  # full module names, as PEFT writes them
                           alpha_pattern={n: config.alpha * r for n, r in ranks.items()})
    wrapped = peft.get_peft_model(base, lora)
    with torch.no_grad():
        for name, layer in layers.items():
            target = wrapped.base_model.model.get_submodule(name)
            target.lora_A["default"].weight.copy_(layer.V.mT)
            target.lora_B["default"].weight.copy_(layer.U @ layer.S)
    wrapped.save_pretrained(str(directory))
    return Path(directory)
