"""Rank enrichment from the tangent-space residual of the vector field."""

from __future__ import annotations

import torch

from ..linalg import orth_against
from ._ksl import Field
from ._state import LowRankState


def enrich(state: LowRankState, field: Field, t: float, delta_r: int, *, alpha: float,
           generator: torch.Generator | None = None, oversample: int = 4) -> LowRankState:
    """Append ``delta_r`` directions to X and V where the field leaves the tangent space.

    R = G − P_F G = (I − XXᵀ) G (I − VVᵀ) with G = field(t, F); a randomized range finder
    (``oversample`` extra columns, one power iteration) gives its leading left and right
    singular directions, which are appended to X and V (kept orthonormal). The new diagonal
    entries of S are ``alpha`` > 0 — never zero padding, which would recreate the deficient
    case — so F changes by exactly α Σ x_new v_newᵀ. Where the residual vanishes, random
    directions orthogonal to X and V are used. Shapes as in :class:`LowRankState`.
    """
    if delta_r < 1 or not alpha > 0:
        raise ValueError(f"need delta_r >= 1 and alpha > 0; got {delta_r}, {alpha}")
    X, S, V = state.X, state.S, state.V
    B, m, r = X.shape
    n = V.shape[1]
    if r + delta_r > min(m, n):
        raise ValueError(f"rank {r} + delta_r {delta_r} exceeds min(m, n) = {min(m, n)}")
    kw = {"dtype": X.dtype, "device": X.device}
    G = field(t, state.dense())
    R = G - X @ (X.mT @ G)
    R = R - (R @ V) @ V.mT
    p = min(delta_r + oversample, min(m, n) - r)
    Y = R @ torch.randn(B, n, p, generator=generator, **kw)
    Y = R @ (R.mT @ Y)  # one power iteration
    Q = orth_against(X, Y)
    Ub, _, Vh = torch.linalg.svd(Q.mT @ R, full_matrices=False)
    Xn, Vn = Q @ Ub[..., :delta_r], Vh[..., :delta_r, :].mT
    flat = torch.linalg.matrix_norm(R) <= 1e-12 * (torch.linalg.matrix_norm(G) + torch.finfo(X.dtype).tiny)
    if bool(flat.any()):  # no residual: random directions instead
        rx = torch.randn(B, m, delta_r, generator=generator, **kw)
        rv = torch.randn(B, n, delta_r, generator=generator, **kw)
        Xn = torch.where(flat[:, None, None], rx, Xn)
        Vn = torch.where(flat[:, None, None], rv, Vn)
    Xn, Vn = orth_against(X, Xn), orth_against(V, Vn)
    S_new = torch.zeros(B, r + delta_r, r + delta_r, **kw)
    S_new[:, :r, :r] = S
    S_new[:, r:, r:] = alpha * torch.eye(delta_r, **kw)
    return LowRankState(torch.cat([X, Xn], -1), S_new, torch.cat([V, Vn], -1))
