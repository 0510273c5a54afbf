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


def check_saved_ranks(layers: dict, param_groups: list[dict], state_dict: dict) -> None:
    """Refuse (``ValueError``, nothing loaded) a state whose K/L/S moments were saved at other
    ranks than the layers have now: the next step would fail on a shape mismatch."""
    saved_ids = [i for g in state_dict.get("param_groups", []) for i in g.get("params", [])]
    params = [p for g in param_groups for p in g["params"]]
    saved = state_dict.get("state", {})
    by_param = {id(p): saved.get(i) for i, p in zip(saved_ids, params, strict=False)}
    for name, layer in layers.items():
        st = by_param.get(id(layer.S)) or {}
        want = {"K": tuple(layer.U.shape), "L": tuple(layer.V.shape), "S": tuple(layer.S.shape)}
        for key, shape in want.items():
            got = [tuple(v.shape) for v in (st.get(key) or {}).values() if torch.is_tensor(v) and v.ndim == 2]
            if any(g != shape for g in got):
                raise ValueError(
                    f"the optimizer state was saved with layer {name!r} at rank {got[0][1]} (its {key} "
                    f"moments are {got[0][0]}×{got[0][1]}), but the layer is at rank {layer.rank} now: "
                    "load the model's state_dict (it carries the ranks) before the optimizer's")


def tidy(opt, start) -> None:
    """After torch's load: the settings are the optimizer's whatever was saved, a state saved
    without a target starts the budget schedule here, τ defaults, and the K/L/S moments go back
    to the integrator's working precision (torch casts them to the dtype of S)."""
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
        for key in ("K", "L", "S"):
            st[key] = {k: v.to(dt) if torch.is_tensor(v) and v.is_floating_point() else v
                       for k, v in st.get(key, {}).items()}
