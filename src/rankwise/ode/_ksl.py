r"""The projector-splitting (K, S, L) integrator and its exact reverse.

One forward step of size h from F0 = X0 S0 V0ᵀ (Lubich & Oseledets 2014, Lie–Trotter order):

1. K-step, V0 fixed: K' = G(t, K V0ᵀ) V0 from K0 = X0 S0; then K1 = X1 Ŝ1 (QR).
2. S-step, backward in time: S' = −X1ᵀ G(t_S, X1 S V0ᵀ) V0 from Ŝ1; gives S̃0.
3. L-step, X1 fixed: L' = G(t, X1 Lᵀ)ᵀ X1 from L0 = V0 S̃0ᵀ; then L1 = V1 S1ᵀ (QR).

The S-substep's time t_S is where its backward Euler step starts: t_S = t + h
(``s_time="end"``, the textbook ordering), or t_S = t (``s_time="start"``, **causal**). For a
field driven by a piecewise-constant input (element i on [i·h, (i+1)·h)), "end" makes step i
read element i + 1; "start" keeps every substep of step i on element i. Both are first-order
consistent (they differ by O(h) in one substep of a first-order method) and both have the
exact reverse below.

Every substep is one explicit Euler step y1 = y0 + h f(y0). Running the substeps at −h is
NOT an inverse: it leaves an O(h²) defect even at full rank. :func:`ksl_reverse` instead
inverts each substep exactly — it solves y0 + h f(y0) = y1 by fixed-point iteration, plain or
Anderson-accelerated (implicit Euler for the reverse, :mod:`._implicit`), to roundoff — and
undoes the substeps in reverse order.
The QR re-factorisations are undone by multiplying the factors back; the K- and S-steps are
equivariant under rotations of V0, so the rotation a QR introduces does not matter. Where a
re-factorisation meets a numerically singular core, the directions it discards cannot be
recovered: that is the only place reversal loses information.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor

from ..linalg import orthonormalize
from ._field import FactoredField
from ._implicit import solve_implicit_euler
from ._state import LowRankState

Field = Callable[[float, Tensor], Tensor]  # field(t, F (B, m, n)) -> dF/dt (B, m, n), or a FactoredField
S_TIMES = ("end", "start")  # where the S-substep reads the field: t + h (textbook) or t (causal)


def s_substep_time(t: float, h: float, s_time: str) -> float:
    """The time at which a step from t evaluates its S-substep (see the module docstring)."""
    if s_time not in S_TIMES:
        raise ValueError(f"`s_time` must be one of {', '.join(map(repr, S_TIMES))}; got {s_time!r}")
    return t + h if s_time == "end" else t


def _k_rhs(field: Field, t: float, V: Tensor) -> Callable[[Tensor], Tensor]:
    if isinstance(field, FactoredField):  # from the factors: F is never formed
        return field.bind_right(t, V)
    return lambda K: field(t, K @ V.mT) @ V


def _s_rhs(field: Field, t: float, X: Tensor, V: Tensor) -> Callable[[Tensor], Tensor]:
    if isinstance(field, FactoredField):
        bound = field.bind_project(t, X, V)
        return lambda S: -bound(S)
    return lambda S: -(X.mT @ field(t, X @ S @ V.mT) @ V)


def _l_rhs(field: Field, t: float, X: Tensor) -> Callable[[Tensor], Tensor]:
    if isinstance(field, FactoredField):
        return field.bind_left(t, X)
    return lambda L: field(t, X @ L.mT).mT @ X


def _step(state: LowRankState, field: Field, t: float, h: float,
          s_time: str = "end") -> tuple[LowRankState, Tensor]:
    """One forward step -> (F1, S̃0): the new state and the S-substep's result, from which
    :func:`step_rotations` gives the rotations the reverse's QR of L0 introduces."""
    X0, S0, V0 = state.X, state.S, state.V
    K1 = X0 @ S0 + h * _k_rhs(field, t, V0)(X0 @ S0)
    X1, S_hat = orthonormalize(K1)
    S_tilde = S_hat + h * _s_rhs(field, s_substep_time(t, h, s_time), X1, V0)(S_hat)
    L0 = V0 @ S_tilde.mT
    L1 = L0 + h * _l_rhs(field, t, X1)(L0)
    V1, St = orthonormalize(L1)
    return LowRankState(X1, St.mT, V1), S_tilde


def ksl_step(state: LowRankState, field: Field, t: float, h: float, *, s_time: str = "end",
             return_rotations: bool = False) -> LowRankState | tuple[LowRankState, tuple[Tensor, Tensor]]:
    """One KSL step of size h (explicit Euler substeps), the S-substep at ``s_time`` ("end":
    t + h; "start": t, causal). Shapes as in :class:`LowRankState`.

    ``return_rotations``: also return the two r×r rotations (Q_x, Q_v) that the reverse's QRs
    will introduce — QR(X0 S0) = X0·Q_x·R and QR(V0 S̃0ᵀ) = V0·Q_v·R with Q_x, Q_v from QR(S0),
    QR(S̃0ᵀ) — for ``ksl_reverse(..., rotations=...)`` to return the forward's own factors.
    (Two more QRs per step: only on request.)"""
    out, S_tilde = _step(state, field, t, h, s_time)
    if not return_rotations:
        return out
    with torch.no_grad():
        rotations = orthonormalize(state.S.detach())[0], orthonormalize(S_tilde.detach().mT)[0]
    return out, rotations


def ksl_reverse(state: LowRankState, field: Field, t: float, h: float, *, s_time: str = "end",
                rotations: tuple[Tensor, Tensor] | None = None, solver: str = "picard") -> LowRankState:
    """The inverse of :func:`ksl_step` (same t, h and s_time): from Φ_h(F0) back to F0, up to
    roundoff at full rank. Without ``rotations`` the factors of F0 come back in rotated bases;
    with the (Q_x, Q_v) that ``ksl_step(..., return_rotations=True)`` reported, the forward's own
    factors come back.
    ``solver``: how the implicit substeps are solved, "anderson" or "picard" (:mod:`._implicit`)."""

    def invert(f: Callable[[Tensor], Tensor], y1: Tensor) -> Tensor:  # y0 with y0 + h f(y0) = y1
        return solve_implicit_euler(f, y1, h, solver=solver)[0]

    X1, S1, V1 = state.X, state.S, state.V
    L1 = V1 @ S1.mT
    L0 = invert(_l_rhs(field, t, X1), L1)
    V0, St = orthonormalize(L0)  # L0 = V0' R with V0' = V0 Q_v
    S_tilde = St.mT
    if rotations is not None:
        V0, S_tilde = V0 @ rotations[1].mT, S_tilde @ rotations[1].mT
    S_hat = invert(_s_rhs(field, s_substep_time(t, h, s_time), X1, V0), S_tilde)
    K1 = X1 @ S_hat
    K0 = invert(_k_rhs(field, t, V0), K1)
    X0, S0 = orthonormalize(K0)  # K0 = X0' R with X0' = X0 Q_x
    if rotations is not None:
        X0, S0 = X0 @ rotations[0].mT, rotations[0] @ S0
    return LowRankState(X0, S0, V0)


def relative_error(a: LowRankState, b: LowRankState) -> Tensor:
    """‖a − b‖_F / (‖b‖_F + ε) per batch element, on the products X S Vᵀ. (B,)"""
    Fa, Fb = a.dense(), b.dense()
    return torch.linalg.matrix_norm(Fa - Fb) / (torch.linalg.matrix_norm(Fb) + torch.finfo(Fb.dtype).tiny)


def reversal_defect(state: LowRankState, field: Field, t: float, h: float, *, s_time: str = "end") -> Tensor:
    """δ = ‖Φ⁻¹_h(Φ_h(F)) − F‖_F / (‖F‖_F + ε) per batch element, on the products X S Vᵀ. (B,)"""
    step = ksl_step(state, field, t, h, s_time=s_time)
    return relative_error(ksl_reverse(step, field, t, h, s_time=s_time), state)


def rank_ratio(state: LowRankState) -> Tensor:
    """ρ = σ_min(S) / (σ_max(S) + ε) per batch element. (B,)"""
    s = torch.linalg.svdvals(state.S)
    return s[..., -1] / (s[..., 0] + torch.finfo(s.dtype).tiny)
