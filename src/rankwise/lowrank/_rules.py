"""Elementwise update rules (SGD with momentum, Adam) as pure functions with explicit state,
and the transport of their state when a low-rank basis rotates or changes rank.

A rule maps ``(grad, param, state, hyper) -> (delta, state)``; the caller applies
``param + delta``. State is a plain dict of tensors and ints, so it round-trips through
``torch.optim.Optimizer.state_dict``.
"""

from __future__ import annotations

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


def adam(grad: Tensor, param: Tensor, state: State, hp: Mapping[str, Any]) -> tuple[Tensor, State]:
    """Adam with L2 weight decay added to the gradient, as ``torch.optim.Adam``:
    ``Δ = −lr · m̂ / (√v̂ + eps)`` with bias-corrected moments. Pure, like :func:`sgd`."""
    b1, b2 = hp["betas"]
    g = grad + hp["weight_decay"] * param if hp["weight_decay"] else grad
    m, v = state.get("m"), state.get("v")
    m = (1 - b1) * g if m is None else b1 * m.to(g.dtype) + (1 - b1) * g
    v = (1 - b2) * g * g if v is None else b2 * v.to(g.dtype) + (1 - b2) * g * g
    step = state.get("step", 0) + 1
    mhat = m / (1 - b1**step)
    vhat = v / (1 - b2**step)
    return -hp["lr"] * mhat / (vhat.sqrt() + hp["eps"]), {**state, "m": m, "v": v, "step": step}


def transport(state: State, left: Tensor | None, right: Tensor | None) -> State:
    """Move a rule's state into new coordinates: ``X ↦ leftᵀ X right``.

    First moments (``m``) rotate linearly; second moments (``v``) rotate through their square
    roots, ``v ↦ (leftᵀ √v right)²``; directions new to the basis get zero; the step count is
    kept. ``left`` (r0, r1) / ``right`` (c0, c1) are old-to-new coordinate maps such as
    ``U0ᵀ U1``; ``None`` leaves that side alone. Exact for a signed permutation; for the first
    moment exact for any rotation.
    """
    def move(x: Tensor) -> Tensor:
        x = x if left is None else left.mT.to(x) @ x
        return x if right is None else x @ right.to(x)

    out = dict(state)
    if state.get("m") is not None:
        out["m"] = move(state["m"])
    if state.get("v") is not None:
        out["v"] = move(state["v"].sqrt()).square()
    return out


@torch.no_grad()
def apply_rule(rule: Rule, p: Tensor, state: State, hp: Mapping[str, Any]) -> None:
    """Update a dense parameter in place from its ``.grad`` (no-op without one); ``state`` (the
    optimizer's dict for ``p``) is updated in place."""
    if p.grad is None:
        return
    delta, new = rule(p.grad, p, state, hp)
    state.update(new)
    p.add_(delta)
