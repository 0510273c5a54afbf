"""Frames (gauge) and defects: comparing factored states whose factors may be rotated.

A reconstructed state has the right product F but factors in other bases than the forward's
(each QR picks a frame). A loss that depends on the factors only through F and the spans of X
and V is blind to X → XQ₁, S → Q₁ᵀSQ₂, V → VQ₂, and a cotangent is carried from one frame to
another by the r×r rotations between them.
"""

from __future__ import annotations

import torch
from torch import Tensor

from ._ksl import relative_error
from ._state import LowRankState
from ._tape import _eps


def _rel(a: LowRankState, b: LowRankState) -> float:
    return float(relative_error(a, b).max())


def _rel_factors(a: LowRankState, b: LowRankState) -> float:
    """Largest relative difference of the factors X, S, V (not only of the product: with an
    ill-conditioned core the product can be right while the factors are rotated)."""
    tiny = torch.finfo(b.S.dtype).tiny
    return max(float((torch.linalg.matrix_norm(x - y) / (torch.linalg.matrix_norm(y) + tiny)).max())
               for x, y in ((a.X, b.X), (a.S, b.S), (a.V, b.V)))


def _frame_invariant(st: LowRankState, g: tuple[Tensor | None, ...]) -> bool:
    """Is the cotangent ``g`` of (X, S, V) blind to the factors' frame? A loss invariant under
    X → XQ₁, S → Q₁ᵀSQ₂, V → VQ₂ has skew(XᵀG_X − G_S Sᵀ) = 0 and skew(SᵀG_S + VᵀG_V) = 0."""
    gX, gS, gV = (torch.zeros_like(t) if x is None else x for t, x in zip((st.X, st.S, st.V), g, strict=True))
    a, b = st.X.mT @ gX, gS @ st.S.mT
    c, d = st.S.mT @ gS, st.V.mT @ gV
    tol = 1e3 * _eps(st)

    def skew_small(p: Tensor, q: Tensor) -> bool:
        m = p - q
        scale = torch.linalg.matrix_norm(p) + torch.linalg.matrix_norm(q) + torch.finfo(p.dtype).tiny
        return bool((torch.linalg.matrix_norm(m - m.mT) <= tol * scale).all())

    return skew_small(a, b) and skew_small(c, -d)


def _align(out: LowRankState, ref: LowRankState) -> tuple[Tensor, Tensor]:
    """Rotations (Rx, Rv), (B, r, r), taking ``ref``'s frame to ``out``'s: out.X ≈ ref.X Rx."""
    return ref.X.mT @ out.X, ref.V.mT @ out.V
