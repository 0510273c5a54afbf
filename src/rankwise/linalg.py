"""Small shared numerics: pure functions on tensors.

Everything here is dtype-agnostic and never divides by a singular value without a guard.
"""

from __future__ import annotations

import torch
from torch import Tensor

__all__ = ["orth_extend", "tail_rank", "truncated_svd", "work_dtype"]


def work_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype integrator math runs in: ``dtype`` itself if it is float32/float64,
    else float32 (half precision models are integrated in float32)."""
    return dtype if dtype in (torch.float32, torch.float64) else torch.float32


def orth_extend(Q0: Tensor, *blocks: Tensor, rtol: float | None = None) -> Tensor:
    """Orthonormal basis of ``span[Q0, blocks...]`` whose first columns are ``Q0`` itself.

    ``Q0`` (m, r) should have orthonormal columns; if it has drifted from orthonormality by
    more than 100·eps (e.g. factors stored in lower precision), it is re-orthonormalised first
    (same span, signs kept), so the result is orthonormal and spans ``Q0``. The extra columns
    are normalised to unit
    length, projected off ``Q0`` twice (classical Gram-Schmidt with re-orthogonalisation),
    and the range of the residual is found by QR followed by an SVD of the small triangular
    factor; directions whose singular value is below ``rtol`` (relative to unit columns) are
    numerically dependent and dropped. Zero columns are ignored.

    **Arguments:**
    - `Q0`: (m, r) orthonormal columns (r may be 0).
    - `blocks`: tensors of shape (m, c_i).
    - `rtol`: drop threshold; default ``sqrt(eps)`` of the dtype.

    **Returns:** (m, r + e) orthonormal columns, ``e <= sum(c_i)``; the first r columns are
    ``Q0`` (or its re-orthonormalised version).
    """
    m = Q0.shape[0]
    Q0 = _reorthonormalize(Q0)
    extra = [b for b in blocks if b.numel() > 0]
    if not extra:
        return Q0
    X = torch.cat(extra, dim=1).to(Q0.dtype)
    if X.shape[0] != m:
        raise ValueError(f"blocks must have {m} rows like Q0; got {X.shape[0]}")
    norms = torch.linalg.vector_norm(X, dim=0)
    keep = norms > torch.finfo(X.dtype).tiny
    if not bool(keep.any()):
        return Q0
    X = X[:, keep] / norms[keep]
    for _ in range(2):
        X = X - Q0 @ (Q0.mT @ X)
    if rtol is None:
        rtol = torch.finfo(X.dtype).eps ** 0.5
    Q, R = torch.linalg.qr(X)
    P, s, _ = torch.linalg.svd(R)
    e = int((s > rtol).sum())
    if e == 0:
        return Q0
    # Q P[:, :e] is orthonormal, and ⟂ Q0 to roundoff after two projections ("twice is enough")
    return torch.cat([Q0, Q @ P[:, :e]], dim=1)


def _reorthonormalize(Q0: Tensor) -> Tensor:
    r = Q0.shape[1]
    eye = torch.eye(r, dtype=Q0.dtype, device=Q0.device)
    if r == 0 or float((Q0.mT @ Q0 - eye).abs().max()) <= 100 * torch.finfo(Q0.dtype).eps:
        return Q0
    Q, R = torch.linalg.qr(Q0)
    return Q * torch.where(torch.diagonal(R) < 0, -1.0, 1.0).to(Q.dtype)


def tail_rank(s: Tensor, tol: float, *, min_rank: int = 1, max_rank: int | None = None) -> int:
    """Smallest rank r with ``sqrt(sum_{i>=r} s_i^2) <= tol``, clamped to [min_rank, max_rank].

    ``s`` (k,) are singular values in descending order. The clamp never exceeds ``k``.
    """
    k = s.numel()
    hi = k if max_rank is None else min(k, max_rank)
    # tails[i] = || s[i:] ||_2 ; tails[k] = 0
    sq = torch.cat([s.flip(0).square().cumsum(0).flip(0), s.new_zeros(1)])
    tails = sq.clamp_min(0).sqrt()
    r = int((tails > tol).sum())  # tails is non-increasing: first index with tail <= tol
    return max(min(r, hi), min(min_rank, hi))


def truncated_svd(
    W: Tensor, *, rank: int | None = None, tau: float | None = None
) -> tuple[Tensor, Tensor, Tensor]:
    """Truncated SVD ``W ~= U diag(s) V^T`` of a matrix (m, n).

    With ``rank`` the first ``rank`` triplets are kept; with ``tau`` the smallest rank whose
    discarded tail satisfies ``||tail||_F <= tau * ||W||_F``; with both, the smaller of the two.

    **Returns:** U (m, r), s (r,), V (n, r).
    """
    if rank is None and tau is None:
        raise ValueError("give `rank` or `tau` (or both) for a truncated SVD")
    if tau is not None and not 0.0 <= tau < 1.0:
        raise ValueError(f"`tau` must be in [0, 1); got {tau}")
    m, n = W.shape
    full = min(m, n)
    if rank is not None and rank < 1:
        raise ValueError(f"`rank` must be >= 1; got {rank}")
    U, s, Vh = torch.linalg.svd(W, full_matrices=False)
    r = full if rank is None else min(rank, full)
    if tau is not None:
        r = min(r, tail_rank(s, tau * float(torch.linalg.vector_norm(s))))
    return U[:, :r], s[:r], Vh[:r].mT
