"""Elementwise update rules (SGD with momentum, Adam) as pure functions with explicit state,
and the transport of their state when a low-rank basis rotates or changes rank.

A rule maps ``(grad, param, state, hyper) -> (delta, state)``; the caller applies
``param + delta``. State is a plain dict of tensors and ints, so it round-trips through
``torch.optim.Optimizer.state_dict``.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch import Tensor

State = dict[str, Any]
Rule = Callable[[Tensor, Tensor, State, Mapping[str, Any]], tuple[Tensor, State]]


def sgd(grad: Tensor, param: Tensor, state: State, hp: Mapping[str, Any]) -> tuple[Tensor, State]:
    """``g ← g + wd·p``; ``m ← μ m + g`` (m = g on the first step); ``Δ = −lr·m``
    (plain SGD when μ = 0), as ``torch.optim.SGD`` without dampening. Pure: returns a new
    state and never modifies ``state``."""
    g = grad + hp["weight_decay"] * param if hp["weight_decay"] else grad
    mu = hp["momentum"]
    if not mu:
        return -hp["lr"] * g, dict(state)
    m = state.get("m")
    m = g.clone() if m is None else mu * m.to(g.dtype) + g
    return -hp["lr"] * m, {**state, "m": m}


def _decoupled(hp: Mapping[str, Any]) -> bool:
    """Is the weight decay decoupled (``torch.optim.AdamW``: ``p ← p − lr·wd·p`` beside the
    step) rather than L2 (``g + wd·p`` into the moments)? ``hp["decoupled_weight_decay"]``;
    absent in groups saved before it, and then False."""
    return bool(hp["weight_decay"]) and bool(hp.get("decoupled_weight_decay", False))


def adam(grad: Tensor, param: Tensor, state: State, hp: Mapping[str, Any]) -> tuple[Tensor, State]:
    """Adam as ``torch.optim.Adam``: ``Δ = −lr · m̂ / (√v̂ + eps)`` with bias-corrected moments of
    ``g + wd·p`` (L2 weight decay); with ``hp["decoupled_weight_decay"]`` (as
    ``torch.optim.AdamW``) the moments see ``g`` alone and ``Δ`` gains ``−lr·wd·p``.
    Pure, like :func:`sgd`."""
    b1, b2 = hp["betas"]
    wd, decoupled = hp["weight_decay"], _decoupled(hp)
    g = grad + wd * param if wd and not decoupled else grad
    m, v = state.get("m"), state.get("v")
    m = (1 - b1) * g if m is None else b1 * m.to(g.dtype) + (1 - b1) * g
    v = (1 - b2) * g * g if v is None else b2 * v.to(g.dtype) + (1 - b2) * g * g
    step = state.get("step", 0) + 1
    mhat = m / (1 - b1 ** (step - state.get("m_from", 0)))  # a moment restarted at step s: t − s
    vhat = v / (1 - b2 ** (step - state.get("v_from", 0)))
    delta = -hp["lr"] * mhat / (vhat.sqrt() + hp["eps"])
    if decoupled:
        delta = delta - (hp["lr"] * wd) * param
    return delta, {**state, "m": m, "v": v, "step": step}


NS_COEFFICIENTS = (3.4445, -4.7750, 2.0315)  # Muon's quintic Newton–Schulz (torch.optim.Muon's defaults)


def newton_schulz(X: Tensor, steps: int = 5, coefficients: tuple[float, float, float] = NS_COEFFICIENTS,
                  eps: float = 1e-7) -> Tensor:
    """Muon's orthogonalisation of (a batch of) matrices X (..., A, B): X scaled to Frobenius
    norm 1, then `steps` quintic Newton–Schulz iterations ``Y ← aY + (b YYᵀ + c (YYᵀ)²) Y`` on
    the wide orientation. The result has X's singular vectors and singular values near 1 (in
    about [0.7, 1.2] with these coefficients: not exactly UVᵀ, by design). Zero rows or columns
    (a padded layer) stay zero. In X's dtype (``torch.optim.Muon`` works in bfloat16)."""
    a, b, c = coefficients
    tall = X.shape[-2] > X.shape[-1]
    Y = X.mT if tall else X
    Y = Y / Y.norm(dim=(-2, -1), keepdim=True).clamp(min=eps)
    for _ in range(steps):
        A = Y @ Y.mT
        Y = a * Y + (b * A + c * (A @ A)) @ Y
    return Y.mT if tall else Y


def weight_scale(m: int, n: int) -> float:
    """The factor of Muon's rate for an m×n weight (``adjust_lr_fn="match_rms_adamw"``): an
    orthogonalised step of that shape then has AdamW's update RMS of about 0.2."""
    return 0.2 * math.sqrt(max(m, n))


def muon(grad: Tensor, param: Tensor, state: State, hp: Mapping[str, Any]) -> tuple[Tensor, State]:
    """Muon as ``torch.optim.Muon(adjust_lr_fn="match_rms_adamw")``: ``m ← μ m + (1 − μ) g``,
    ``u = (1 − μ) g + μ m`` (Nesterov; ``u = m`` without), ``Δ = −lr · s · NS(u) − lr·wd·p``
    with :func:`newton_schulz` on each matrix of a batch (..., A, B). ``s`` is
    ``hp["weight_scale"]`` (a number, or a tensor broadcasting over the batch) where the caller
    gives it — for a factor K, L or core S of a low-rank layer, the layer's weight's
    :func:`weight_scale`, so that the weight U S Vᵀ moves by as much, in spectral norm, as Muon
    moves a dense weight — else that of the matrix's own shape (then exactly torch's rule, up
    to its bfloat16). Pure, like :func:`sgd`."""
    mu = hp["momentum"]
    m = state.get("m")
    m = (1 - mu) * grad if m is None else mu * m.to(grad.dtype) + (1 - mu) * grad
    u = (1 - mu) * grad + mu * m if hp["nesterov"] else m
    scale = hp.get("weight_scale")
    scale = weight_scale(*grad.shape[-2:]) if scale is None else scale
    delta = newton_schulz(u, hp["ns_steps"]) * (-hp["lr"] * scale)
    if hp["weight_decay"]:
        delta = delta - (hp["lr"] * hp["weight_decay"]) * param
    return delta, {**state, "m": m}


def restart(state: State, key: str) -> State:
    """`state` with moment `key` (``"m"`` or ``"v"``) started afresh and the others kept: the
    moment removed and, where the rule counts steps (Adam), the step it restarts at recorded as
    ``"m_from"`` / ``"v_from"``, so that its bias correction counts from there."""
    if state.get(key) is None:
        return dict(state)
    out = {k: v for k, v in state.items() if k != key}
    if "step" in state:
        out[f"{key}_from"] = state["step"]
    return out


def transport(state: State, left: Tensor | None, right: Tensor | None) -> State:
    """Move a rule's state into new coordinates: ``X ↦ leftᵀ X right``.

    First moments (``m``) rotate linearly; second moments (``v``) are mixed by the squared maps,
    ``v ↦ (left∘left)ᵀ v (right∘right)`` (for unit columns a weighted average of the old
    entries, and unchanged when a basis vector's sign flips: ``(√v T)²`` would depend on the
    signs the SVD happens to return); directions new to the basis get zero; the step count is
    kept. ``left`` (r0, r1) / ``right`` (c0, c1) are old-to-new coordinate maps such as
    ``U0ᵀ U1``; ``None`` leaves that side alone. Exact for a signed permutation; for the first
    moment exact for any rotation.
    """
    def move(x: Tensor, square: bool) -> Tensor:
        a = None if left is None else (left.square() if square else left)
        b = None if right is None else (right.square() if square else right)
        x = x if a is None else a.mT.to(x) @ x
        return x if b is None else x @ b.to(x)

    out = dict(state)
    if state.get("m") is not None:
        out["m"] = move(state["m"], False)
    if state.get("v") is not None:
        out["v"] = move(state["v"], True)
    return out


def foreach_update(name: str, grads: list[Tensor], params: list[Tensor], states: list[State],
                   hp: Mapping[str, Any]) -> tuple[list[Tensor], list[State]]:
    """:func:`sgd` (`name` ``"sgd"``) or :func:`adam` (``"adam"``, ``"adamw"``, and ``"muon"``,
    whose dense parameters take AdamW: the decay as ``hp["decoupled_weight_decay"]`` says) of
    many tensors at once, with ``torch._foreach_*``
    ops: a constant number of dispatched ops however many tensors. The states must agree in
    which moments they hold and in Adam's step count (the caller groups them so). Pure, like
    the rules: returns the deltas and new states."""
    if not grads:
        return [], []
    wd = hp["weight_decay"]
    decoupled = name != "sgd" and _decoupled(hp)
    g = torch._foreach_add(grads, torch._foreach_mul(params, wd)) if wd and not decoupled else grads
    first = states[0]
    if name == "sgd":
        mu = hp["momentum"]
        if not mu:
            return torch._foreach_mul(g, -hp["lr"]), [dict(s) for s in states]
        if first.get("m") is None:
            m = [t.clone() for t in g] if g is grads else list(g)
        else:
            m = torch._foreach_add(torch._foreach_mul([s["m"] for s in states], mu), g)
        return torch._foreach_mul(m, -hp["lr"]), [{**s, "m": mi} for s, mi in zip(states, m, strict=True)]
    if name not in ("adam", "adamw", "muon"):  # muon: its dense parameters take AdamW (Muon's recipe)
        raise ValueError(f"no foreach form of the rule {name!r}")
    b1, b2 = hp["betas"]
    gb = torch._foreach_mul(g, 1 - b1)
    gg = torch._foreach_mul(torch._foreach_mul(g, 1 - b2), g)
    if first.get("m") is None:
        m = gb
    else:
        m = torch._foreach_add(torch._foreach_mul([s["m"] for s in states], b1), gb)
    if first.get("v") is None:
        v = gg
    else:
        v = torch._foreach_add(torch._foreach_mul([s["v"] for s in states], b2), gg)
    step = first.get("step", 0) + 1
    mhat = torch._foreach_div(m, 1 - b1 ** (step - first.get("m_from", 0)))
    vhat = torch._foreach_div(v, 1 - b2 ** (step - first.get("v_from", 0)))
    den = torch._foreach_add(torch._foreach_sqrt(vhat), hp["eps"])
    delta = torch._foreach_div(torch._foreach_mul(mhat, -hp["lr"]), den)
    if decoupled:
        delta = torch._foreach_add(delta, torch._foreach_mul(params, -hp["lr"] * wd))
    return delta, [{**s, "m": mi, "v": vi, "step": step} for s, mi, vi in zip(states, m, v, strict=True)]
