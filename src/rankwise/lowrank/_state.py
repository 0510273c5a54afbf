"""An optimizer's saved state, checked before torch loads it and tidied after."""

from __future__ import annotations

import warnings

import torch

from ..linalg import work_dtype


def warn_other_policies(settings, state_dict: dict) -> None:
    """A state saved under other policies (truncation, feedback, buffer) is allowed (e.g. τ
    first, then a budget), but more often a mistake: say so."""
    group = next(iter(state_dict.get("param_groups", [])), {})
    mine = settings.to_dict()
    if "settings" in group:
        saved = {k: group["settings"].get(k) for k in ("truncation", "feedback", "buffer")}
        differ = saved != {k: mine[k] for k in saved}
        saved_text = ", ".join(f"{k}={v!r}" for k, v in saved.items())
    else:  # saved before the settings objects: the policies as text, or nothing
        saved_text = group.get("policies")
        differ = saved_text is not None and saved_text != settings.policies()
    if differ:
        warnings.warn(f"loading an optimizer state saved under other policies ({saved_text}) into one "
                      f"with {settings.policies()}; the step count, moments and each layer's τ "
                      "carry over, the policies are this optimizer's", UserWarning, stacklevel=3)


def _by_param(param_groups: list[dict], state_dict: dict) -> dict[int, int]:
    """{id(parameter): its index in the saved state_dict} (the saved groups' order)."""
    saved_ids = [i for g in state_dict.get("param_groups", []) for i in g.get("params", [])]
    params = [p for g in param_groups for p in g["params"]]
    return {id(p): i for i, p in zip(saved_ids, params, strict=False)}


def flattened(layers: dict, param_groups: list[dict], state_dict: dict) -> dict:
    """A state saved with each layer's rule states nested under S (``{"K": {...}, "L": {...},
    "S": {...}}``, before the state was flat) converted: K's under U, L's under V, S's beside
    the layer's counters under S. A flat state is returned as it is."""
    index = _by_param(param_groups, state_dict)
    saved = state_dict.get("state", {})
    nested = [m for m in layers.values() if isinstance(saved.get(index.get(id(m.S))), dict)
              and isinstance(saved[index[id(m.S)]].get("K"), dict)]
    if not nested:
        return state_dict
    state = dict(saved)
    for m in nested:
        st = dict(state[index[id(m.S)]])
        K, L, S = st.pop("K"), st.pop("L", {}), st.pop("S", {})
        state[index[id(m.S)]] = {**st, **S}
        for p, sub in ((m.U, K), (m.V, L)):
            if id(p) in index and sub:
                state[index[id(p)]] = dict(sub)
    return {**state_dict, "state": state}


def check_saved_ranks(layers: dict, param_groups: list[dict], state_dict: dict) -> None:
    """Refuse (``ValueError``, nothing loaded) a state whose K/L/S moments were saved at other
    ranks than the layers have now: the next step would fail on a shape mismatch."""
    index = _by_param(param_groups, state_dict)
    saved = state_dict.get("state", {})
    for name, layer in layers.items():
        for key, p in (("K", layer.U), ("L", layer.V), ("S", layer.S)):
            st = saved.get(index.get(id(p))) or {}
            got = [tuple(st[k].shape) for k in ("m", "v") if torch.is_tensor(st.get(k)) and st[k].ndim == 2]
            if any(g != tuple(p.shape) for g in got):
                raise ValueError(
                    f"the optimizer state was saved with layer {name!r} at rank {got[0][1]} (its {key} "
                    f"moments are {got[0][0]}×{got[0][1]}), but the layer is at rank {layer.rank} now: "
                    "load the model's state_dict (it carries the ranks) before the optimizer's")


def tidy(opt, start) -> None:
    """After torch's load: the settings are the optimizer's whatever was saved, a state saved
    without a target starts the budget schedule here, τ defaults, and the K/L/S moments go back
    to the integrator's working precision (torch casts them to their parameter's dtype)."""
    mine = opt.settings.to_dict()
    for g in opt.param_groups:
        g.pop("policies", None)
        g["settings"] = mine
    if start is not None:
        opt.param_groups[0].setdefault("budget_start", start)
    for layer in opt.layers.values():
        st, dt = opt.state[layer.S], work_dtype(layer.S.dtype)
        if not opt.settings.budgeted:
            st.setdefault("tau", opt.settings.tau)  # a state saved under a budget has none
        for p in (layer.U, layer.V, layer.S):
            moments = opt.state[p]
            for k in ("m", "v"):
                if torch.is_tensor(moments.get(k)):
                    moments[k] = moments[k].to(dt)
