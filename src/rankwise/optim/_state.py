"""An optimizer's saved state, checked before torch loads it and tidied after."""

from __future__ import annotations

import math
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


def refuse_nested(layers: dict, param_groups: list[dict], state_dict: dict) -> None:
    """Refuse (``ValueError``, nothing loaded) a state whose layers keep their rule states nested
    under S (``{"K": {...}, "L": {...}, "S": {...}}``): a development layout that no release had,
    which would otherwise load and leave U's and V's moments to start afresh."""
    index = _by_param(param_groups, state_dict)
    saved = state_dict.get("state", {})
    if not isinstance(saved, dict):
        return
    for name, m in layers.items():
        st = saved.get(index.get(id(m.S)))
        if isinstance(st, dict) and isinstance(st.get("K"), dict):
            raise ValueError(f"optimizer state: layer {name!r} keeps its rule states nested under S ('K', "
                             "'L', 'S'), the layout of a development version of rankwise, which is not read")


def check_saved_ranks(layers: dict, param_groups: list[dict], state_dict: dict) -> None:
    """Refuse (``ValueError``, nothing loaded) a state whose K/L/S moments were saved at other
    ranks than the layers have now (the next step would fail on a shape mismatch), and one that
    no optimizer here could have written: a moment (``m``, ``v``) that is not a tensor of its
    parameter's shape (a K moment of shape (r,), a 3-D one), a τ that is not a number in [0, 1)
    (NaN), a budget's tail outside [0, 1], a step count or a layer's counter that is not a
    whole number >= 0. Each message names the layer (or parameter) and the key."""
    index = _by_param(param_groups, state_dict)
    saved = state_dict.get("state", {})
    sizes = [len(g.get("params", [])) for g in state_dict.get("param_groups", [])]
    if not isinstance(saved, dict) or sizes != [len(g["params"]) for g in param_groups]:
        return  # torch's own load refuses other groups in one line
    for name, layer in layers.items():
        # the moments' shape: at the live rank, or the parameter's at a fixed capacity
        U, S, V = layer.factors() if layer.capacity is None else (layer.U, layer.S, layer.V)
        for key, p, live in (("K", layer.U, U), ("L", layer.V, V), ("S", layer.S, S)):
            st = saved.get(index.get(id(p))) or {}
            got = [tuple(st[k].shape) for k in ("m", "v") if torch.is_tensor(st.get(k)) and st[k].ndim == 2]
            # another rank: (out, r') for K, (in, r') for L, (r', r') for S
            other = [g for g in got if g != tuple(live.shape)
                     and (g[0] == g[1] if key == "S" else g[0] == p.shape[0])]
            if other:
                raise ValueError(
                    f"the optimizer state was saved with layer {name!r} at rank {other[0][1]} (its {key} "
                    f"moments are {other[0][0]}×{other[0][1]}), but the layer is at rank {layer.rank} now: "
                    "load the model's state_dict (it carries the ranks) before the optimizer's")
            _check_entry(st, live, f"layer {name!r}", key)
        _check_counters(saved.get(index.get(id(layer.S))) or {}, f"layer {name!r}")
    factors = {id(p) for m in layers.values() for p in (m.U, m.V, m.S)}
    names = {id(p): f"parameter {i}" for i, p in enumerate(p for g in param_groups for p in g["params"])}
    for p in (p for g in param_groups for p in g["params"] if id(p) not in factors):
        _check_entry(saved.get(index.get(id(p))) or {}, p, names[id(p)], "")


_WAY_OUT = "it was not saved by this optimizer for this model: load the state saved with it, or start afresh"


def _check_entry(st, p, where: str, key: str) -> None:
    """One parameter's saved entry: its moments are tensors of the parameter's shape, its step
    a whole number >= 0."""
    if not isinstance(st, dict):
        raise ValueError(f"the optimizer state of {where} is a {type(st).__name__}, not a dict; {_WAY_OUT}")
    of = f"{key} " if key else ""
    for k in ("m", "v"):
        if st.get(k) is None:
            continue
        t = st[k]
        if not torch.is_tensor(t) or not t.is_floating_point():
            what = f"a {type(t).__name__}" if not torch.is_tensor(t) else f"a {t.dtype} tensor"
            raise ValueError(f"the optimizer state of {where} has {of}moment {k!r} {what}, not a "
                             f"floating-point tensor; {_WAY_OUT}")
        if tuple(t.shape) != tuple(p.shape):
            raise ValueError(f"the optimizer state of {where} has {of}moment {k!r} of shape {tuple(t.shape)} "
                             f"where its parameter is {tuple(p.shape)}; {_WAY_OUT}")
    _check_count(st, "step", where)


def _check_count(st: dict, k: str, where: str) -> None:
    v = st.get(k)
    if v is None:
        return
    if torch.is_tensor(v) and v.numel() == 1 and not v.is_complex():
        v = v.item()  # (torch keeps a step as a float tensor)
    if isinstance(v, bool) or not isinstance(v, int | float) or not math.isfinite(v) or v < 0 or v != int(v):
        raise ValueError(f"the optimizer state of {where} has {k!r} = {v!r}, not a whole number >= 0; "
                         f"{_WAY_OUT}")


def _check_counters(st: dict, where: str) -> None:
    """A layer's own entries (under its S): τ in [0, 1), a budget's tail in [0, 1], counters."""
    for k, hi, closed in (("tau", 1.0, False), ("tail", 1.0, True)):
        if k not in st:
            continue
        v = st[k]
        if torch.is_tensor(v) and v.numel() == 1:
            v = v.item()
        ok = isinstance(v, int | float) and not isinstance(v, bool) and math.isfinite(v) and v >= 0 \
            and (v <= hi if closed else v < hi)
        if not ok:
            span = "[0, 1]" if closed else "[0, 1)"
            raise ValueError(f"the optimizer state of {where} has {k!r} = {v!r}, not a number in {span}; "
                             f"{_WAY_OUT}")
    for k in ("r_init", "new_directions", "augmentations"):
        _check_count(st, k, where)


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
        st.setdefault("r_init", layer.rank)  # (a state saved before the optimizer held frozen layers)
        if not opt.settings.budgeted:
            st.setdefault("tau", opt.settings.tau)  # a state saved under a budget has none
        for p in (layer.U, layer.V, layer.S):
            moments = opt.state[p]
            for k in ("m", "v"):
                if torch.is_tensor(moments.get(k)):
                    moments[k] = moments[k].to(dt)


def materialise(opt) -> None:
    """Fixed capacity: every entry a step would create, made now (moments as zeros at their
    parameter's shape, Adam's counts as 0), as torch's ``_init_optim_state`` does for
    ``torch.distributed.checkpoint``: a fresh optimizer's ``state_dict()`` then has every key
    and shape a trained one saves, so ``dcp.load`` into it restores all of it. Bit for bit the
    same training: the rules take a zero moment as an absent one (m = μ·0 + g = g, and Adam's
    (1 − β)·g and counts), and a moment restarts as zeros, not by removal (:mod:`._batched`)."""
    cfg = opt.settings
    rule = cfg.rule.name
    momentum = cfg.rule.hyper().get("momentum", 0.0)
    # moments="reset" starts K's and L's afresh at every augmentation: none are kept between steps
    # (S's are, between augmentations, with update_every > 1)
    kept = {id(m.S) for m in opt.layers.values()} if cfg.update_every > 1 else set()
    held = kept if cfg.moments_used == "reset" else set(opt._factor_ids)
    for group in opt.param_groups:
        for p in group["params"]:
            factor = id(p) in opt._factor_ids
            if not p.requires_grad or (factor and id(p) not in held):
                continue
            st = opt.state[p]
            dt = work_dtype(p.dtype) if factor else p.dtype
            adam = rule in ("adam", "adamw") or (rule == "muon" and not factor)  # (Muon's dense: AdamW)
            keys = ("m", "v") if adam else ("m",) if rule == "muon" or momentum else ()
            for k in keys:
                if st.get(k) is None:  # (like the parameter: a DTensor shard under FSDP2)
                    st[k] = torch.zeros_like(p, dtype=dt, memory_format=torch.contiguous_format)
            if adam:
                for k in ("step", "m_from", "v_from"):
                    st.setdefault(k, 0)
    for layer in opt.layers.values():  # (the layer's counters, under its S)
        st = opt.state[layer.S]
        st.setdefault("augmentations", 0)
        st.setdefault("new_directions", 0)  # (read only after an augmentation: :func:`._batched._width`)
        if opt.settings.budgeted:
            st.setdefault("tail", 0.0)
