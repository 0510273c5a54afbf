r"""The rank-adaptive augmented BUG step as functions of tensors and numbers (no optimizer).

As ``torch.optim.adam`` keeps its math in ``_multi_tensor_adam(params, grads, …, lr=…)``, the
optimizer :class:`~rankwise.AugmentedBUG` only collects, calls these functions and writes back.
Everything is batched over a *group* of N layers of one shape: their factors, gradients and
rule states stacked along a leading dimension and zero-padded to the group's largest rank R
and buffer B (:class:`Stack`; the padding's layout is a :class:`._step.Padding`). A group of
one layer, unpadded, is the degenerate case.

1. :func:`plan` (single pass): the rule on K = US, L = VSᵀ and S, re-orthonormalisation when
   asked, augmentation at a fixed width, the Galerkin core and its SVD
   (:func:`._step.plan_group`), each layer's rank under its tolerance (on the device).
   Two-pass BUG splits it: :func:`augment` (rules on K and L, the augmented point, the core
   state in augmented coordinates), the caller's second evaluation at that point, then
   :func:`finish` (the S rule on the new core gradient, the SVD).
2. The caller reads each layer's rank, core size and flags to the host (one transfer) and
   calls :func:`truncate`: the new bases of every layer from one product at the group's widest
   rank, the rule states carried into the new bases (or reset).

Shapes: U (N, m, R), S (N, R, R), V (N, n, R), G_K like U, G_S like S, G_L like V, buffers
(N, m, B), (N, n, B); each layer's own r ≤ R columns first, zeros after.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, NamedTuple

import torch
from torch import Tensor

from ..linalg import batch_mm
from . import _step
from ._integrators import Factors
from .rules._rules import Rule, State, restart, transport, weight_scale

__all__ = ["Factors", "Planned", "Ranks", "Stack", "Truncated", "TwoPass", "all_finite", "augment",
           "augmented_core_state", "by_sensitivity", "core", "finish", "grads_finite", "plan", "scaled",
           "truncate"]

_MOMENTS = ("m", "v")


class Stack(NamedTuple):
    """A group's inputs: its factors and gradients (:class:`._integrators.Factors`, stacked and
    padded), the stacked rule states of K, L and S, the padding (None: every layer at R, B) and
    the caller's cache of fill directions (:func:`._step._fill`; None: drawn per call)."""

    f: Factors
    K: State
    L: State
    S: State
    pad: _step.Padding | None
    fills: dict | None = None


class Planned(NamedTuple):
    """A group's step before truncation: the (re-orthonormalised) factors, the plan (augmented
    bases, core, SVD, sizes, flags), the rule states of this step (K, L, S; not yet in the new
    bases), each layer's rank under its tolerance (None: chosen by the caller), and whether the
    gradients were finite (a device bool)."""

    f: Factors
    plan: _step.GroupPlan
    states: dict[str, State]
    ranks: Tensor | None
    grads_finite: Tensor


class TwoPass(NamedTuple):
    """Two-pass BUG between its phases: the augmented point (Ū, S̄(0), V̄, masks, failure
    flags), the K and L states of this step and the S state in augmented coordinates."""

    f: Factors
    U: Tensor
    S0: Tensor
    V: Tensor
    mU: Tensor
    mV: Tensor
    failed: Tensor
    states: dict[str, State]
    grads_finite: Tensor


class Ranks(NamedTuple):
    """The tolerance rule's numbers per layer (N,): τ, the rank bounds."""

    tau: Tensor
    min_rank: Tensor
    max_rank: Tensor


def all_finite(tensors: list[Tensor], device: torch.device) -> Tensor:
    """A bool on `device`: every tensor (plain, one device) is finite (max-abs by
    ``_foreach_norm(inf)``: never overflows); True for none."""
    if not tensors:
        return torch.ones((), dtype=torch.bool, device=device)
    norms = torch._foreach_norm(tensors, float("inf"))
    return torch.isfinite(torch.stack([n.to(device, torch.float64) for n in norms])).all()


def grads_finite(f: Factors) -> Tensor:
    """A device bool: every factor gradient is finite (:func:`all_finite`)."""
    return all_finite([f.G_K, f.G_L, f.G_S], f.G_K.device)


def _rules(x: Stack, rule: Rule, hp: Mapping[str, Any],
           reorth: bool) -> tuple[Factors, Tensor, Tensor, State, State]:
    f = x.f
    if reorth:
        f = _step.reorthonormalize_group(f, x.pad)
    hp = scaled(hp, f.U.shape[-2], f.V.shape[-2])
    dK, stK = rule(f.G_K, f.U @ f.S, x.K, hp)
    dL, stL = rule(f.G_L, f.V @ f.S.mT, x.L, hp)
    return f, dK, dL, stK, stL


def scaled(hp: Mapping[str, Any], m: int, n: int) -> dict[str, Any]:
    """`hp` with the group's m×n weight's :func:`._rules.weight_scale` (the Muon rule's rate
    factor for K, L and S; the other rules ignore it)."""
    return {**hp, "weight_scale": weight_scale(m, n)}


def plan(x: Stack, rule: Rule, hp: Mapping[str, Any], core_hp: Mapping[str, Any], *, reorth: bool,
         width: int | None, robust: bool, ranks: Ranks | None) -> Planned:
    """One single-pass augmented step of a group up to its SVD (module docstring, 1). `hp`: the
    rule's hyperparameters for K and L, `core_hp` for S; `width`: room for at most this many new
    directions per side (None: all); `robust`: Householder QR where a Cholesky factorisation
    fails; `ranks`: the tolerance rule's numbers (None: the caller chooses the ranks)."""
    finite = grads_finite(x.f)
    f, dK, dL, stK, stL = _rules(x, rule, hp, reorth)
    dS, stS = rule(f.G_S, f.S, x.S, scaled(core_hp, f.U.shape[-2], f.V.shape[-2]))
    p = _step.plan_group(f.U, f.S, f.V, dK, dS, dL, f.U_buf, f.V_buf, width=width, pad=x.pad,
                         robust=robust, fills=x.fills)
    return Planned(f, p, {"K": stK, "L": stL, "S": stS}, _tolerance(p, ranks), finite)


def _tolerance(p: _step.GroupPlan, ranks: Ranks | None) -> Tensor | None:
    """Each layer's rank under its tolerance (:func:`._step.tolerance_ranks`; None: the caller
    chooses)."""
    if ranks is None:
        return None
    return _step.tolerance_ranks(p.s, ranks.tau, ranks.min_rank, ranks.max_rank, p.k)


def augment(x: Stack, rule: Rule, hp: Mapping[str, Any], *, reorth: bool, width: int | None,
            robust: bool) -> TwoPass:
    """Two-pass BUG's first phase: the K and L rules, the augmented bases and the point
    (Ū, S̄(0), V̄) at which the caller evaluates the loss again (the same weight: S̄(0) is S0
    bordered by zeros; fill directions have zero rows), and the S state in augmented
    coordinates (:func:`augmented_core_state`)."""
    finite = grads_finite(x.f)
    f, dK, dL, stK, stL = _rules(x, rule, hp, reorth)
    U, V, mU, mV, failed = _step.augment_group(f.U, f.V, dK, dL, f.U_buf, f.V_buf, width, x.pad, robust,
                                               x.fills)
    r0 = f.S.shape[-1]
    S0 = _step.tangent_blocks(r0, U[..., r0:], V[..., r0:], f.S)
    stS = augmented_core_state(x.S, x.K, x.L, U, V, mU, mV, r0)  # the K and L states before the rules
    return TwoPass(f, U, S0, V, mU, mV, failed, {"K": stK, "L": stL, "S": stS}, finite)


def finish(t: TwoPass, G: Tensor, rule: Rule, core_hp: Mapping[str, Any], *, ranks: Ranks | None) -> Planned:
    """Two-pass BUG's second phase: the S rule on the core gradient G (N, ku, kv) measured at the
    augmented point (fill directions masked out, as if absent), the core's SVD, the ranks."""
    mask = (t.mU[:, :, None] & t.mV[:, None, :]).to(t.S0.dtype)
    core_hp = scaled(core_hp, t.U.shape[-2], t.V.shape[-2])
    dS, stS = rule(G.to(t.S0.dtype) * mask, t.S0, t.states["S"], core_hp)
    S = (t.S0 + dS) * mask
    r0 = t.f.S.shape[-1]
    p = _step.sized_plan(t.U, t.V, S, r0, t.mU, t.mV, t.failed, r0 + t.f.U_buf.shape[-1])
    return Planned(t.f, p, {**t.states, "S": stS}, _tolerance(p, ranks), t.grads_finite)


def augmented_core_state(st_S: State, st_K: State, st_L: State, U: Tensor, V: Tensor, mU: Tensor,
                         mV: Tensor, r0: int) -> State:
    r"""Two-pass BUG: the S rule's state in the augmented coordinates (Ū, V̄) (N, ku, kv), from
    the S, K *and* L states of the old bases (before this step's rule calls); rows and columns
    of fill directions zero.

    The three states together hold the rule's memory of the weight's tangent-space update at
    W0 = U0 S0 V0ᵀ: for SGD the momentum is ``M = U0 m_S V0ᵀ + (I − U0U0ᵀ) m_K V0ᵀ +
    U0 m_Lᵀ (I − V0V0ᵀ)`` (what the single-pass step applies). Its coordinates in the augmented
    bases, ``ŪᵀMV̄``, are, in blocks (Ũ = Ū[:, r0:], Ṽ = V̄[:, r0:]),
    ``[[m_S, m_LᵀṼ], [Ũᵀm_K, 0]]``. The S rule then gives ``m̄ = μ ŪᵀMV̄ + ŪᵀGV̄``, whose
    off-diagonal blocks are ``Ũᵀ(μ m_K + G_K)``: the components of the update that leave the old
    subspaces carry the same momentum as in single-pass mode, and the one block only a second
    pass sees, ŨᵀGṼ, starts without history (exactly the single-pass update plus that block for
    SGD: ``tests/optim/test_two_pass_momentum.py``). ``m_S`` padded with zeros would not do: the
    update outside span(U0) × span(V0) would then be a plain SGD step, 1/(1 − μ) smaller, and
    two-pass training with momentum stalls (LeNet/digits at τ = 0.2: 0.43 test accuracy against
    0.94 single-pass). First moments are assembled linearly, Adam's second moments by the
    squared maps (Ũ∘Ũ, Ṽ∘Ṽ; as :func:`._rules.transport` does); a moment absent from all three
    states stays absent; other entries (Adam's step count) are those of the S state."""
    EU = U[..., r0:] * mU[:, None, r0:].to(U.dtype)
    EV = V[..., r0:] * mV[:, None, r0:].to(V.dtype)
    out = dict(st_S)
    for key, (AU, AV) in (("m", (EU, EV)), ("v", (EU.square(), EV.square()))):
        xS, xK, xL = (None if st.get(key) is None else st[key].to(U) for st in (st_S, st_K, st_L))
        if xS is None and xK is None and xL is None:
            continue
        out[key] = _step.tangent_blocks(r0, AU, AV, xS, xK, xL)
    return out


class Truncated(NamedTuple):
    """A group truncated to its layers' new ranks r1 and buffers b1, at the group's widest:
    ``U`` (N, m, c) = Ū P[:, :c], ``V`` (N, n, c) = V̄ Q[:, :c] (c = max r1 + b1: layer i's new U
    is ``U[i, :, :r1]``, its buffer ``U[i, :, r1:r1 + b1]``), ``S`` (N, t, t) diagonal (t = max
    r1), and the rule states in the new bases (K (N, m, t), L (N, n, t), S (N, t, t); empty
    with ``moments="reset"``)."""

    U: Tensor
    V: Tensor
    S: Tensor
    states: dict[str, State]


def truncate(p: Planned, r1: list[int], b1: list[int], *, moments: str, two_pass: bool) -> Truncated:
    """Truncate a planned group to ranks `r1` and buffer sizes `b1` (host ints, one per layer)
    and carry the rule states into the new bases: K's by V0ᵀV1, L's by U0ᵀU1, S's by both (the
    augmented bases' maps after two-pass BUG, whose S state lives there); ``moments="reset"``
    starts them afresh (Adam's step count too), ``"reset_m"`` / ``"reset_v"`` only the first /
    second moment (:func:`._rules.restart`), carrying the other."""
    plan, r0 = p.plan, p.plan.r0
    c, top = max(r + b for r, b in zip(r1, b1, strict=True)), max(r1)
    U, V = batch_mm(plan.U, plan.P[..., :c]), batch_mm(plan.V, plan.Q[..., :c])
    S = torch.diag_embed(plan.s[:, :top])
    if moments == "reset":
        return Truncated(U, V, S, {"K": {}, "L": {}, "S": {}})
    TU, TV = plan.P[:, :r0, :top], plan.Q[:, :r0, :top]  # old-to-new maps U0ᵀU1, V0ᵀV1
    SU, SV = (plan.P[..., :top], plan.Q[..., :top]) if two_pass else (TU, TV)
    ns = p.states
    if moments in ("reset_m", "reset_v"):
        ns = {k: restart(st, moments[-1]) for k, st in ns.items()}
    return Truncated(U, V, S, {"K": transport(ns["K"], None, TV), "L": transport(ns["L"], None, TU),
                               "S": transport(ns["S"], SU, SV)})


def core(S: Tensor, G: Tensor, state: State, rule: Rule,
         core_hp: Mapping[str, Any]) -> tuple[Tensor, State, Tensor]:
    """Between augmentations: the rule on a group's cores S (N, R, R) with gradients G; returns
    the new cores, the new state and a device bool (the new cores are finite). The group's
    layers may differ in shape: `core_hp` carries their ``weight_scale`` where the rule uses it."""
    dS, new = rule(G, S, state, core_hp)
    S1 = S + dS
    return S1, new, torch.isfinite(S1).all()


def by_sensitivity(p: Planned, previous: tuple[Tensor, Tensor] | None, cost: Tensor, *, beta1: float,
                   beta2: float) -> tuple[Planned, tuple[Tensor, Tensor], Tensor]:
    """The data-aware budget (:mod:`._sensitivity`): each layer's SVD directions reordered by
    their smoothed sensitivity scores (the directions beyond each layer's core size, fills, last).
    `previous`: the smoothed importance and uncertainty of the old directions (N, R) (None: no
    history); `cost` (N,): each layer's parameters per unit of rank (m + n). Returns the
    reordered plan, the smoothed values in that order (N, k) and the scores per cost (N, k)."""
    from . import _sensitivity as sens

    plan, f = p.plan, p.f
    r0 = plan.r0
    EU = plan.U[..., r0:] * plan.mU[:, None, r0:].to(plan.U.dtype)
    EV = plan.V[..., r0:] * plan.mV[:, None, r0:].to(plan.V.dtype)
    G = _step.tangent_blocks(r0, EU, EV, f.G_S, f.G_K, f.G_L)
    inst = sens.importance(plan.P, plan.s, plan.Q, G)
    prev = None if previous is None else sens.Smoothed(previous[0].to(inst), previous[1].to(inst))
    sm = sens.smooth(prev, plan.P, plan.Q, inst, beta1=beta1, beta2=beta2)
    score = sens.scores(sm)
    inside = torch.arange(score.shape[-1], device=score.device) < plan.k[:, None]
    order = torch.argsort(torch.where(inside, score, -torch.inf), dim=-1, descending=True, stable=True)

    def cols(t: Tensor) -> Tensor:
        return t.gather(-1, order[:, None, :].expand(-1, t.shape[-2], -1))

    plan = plan._replace(P=cols(plan.P), s=plan.s.gather(-1, order), Q=cols(plan.Q))
    smoothed = (sm.I.gather(-1, order), sm.U.gather(-1, order))
    return p._replace(plan=plan), smoothed, score.gather(-1, order) / cost[:, None].to(score.dtype)


def __dir__() -> list[str]:
    """The public names only (not this module's own imports)."""
    return list(__all__)
