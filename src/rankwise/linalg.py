"""Small shared numerics: pure functions on tensors.

Everything here is dtype-agnostic and never divides by a singular value without a guard.
"""

from __future__ import annotations

import torch
from torch import Tensor

from ._checks import check_unit_interval

__all__ = ["batch_mm", "gram_rtol", "orth_against", "orthonormalize", "tail_count", "tail_rank",
           "truncated_svd", "work_dtype"]


def work_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype integrator math runs in: ``dtype`` itself if it is float32/float64,
    else float32 (half precision models are integrated in float32)."""
    return dtype if dtype in (torch.float32, torch.float64) else torch.float32


def orthonormalize(Q: Tensor) -> tuple[Tensor, Tensor]:
    """Thin QR ``Q = Q' R`` with ``diag(R) >= 0``: (..., m, k) -> Q' (..., m, k) orthonormal,
    R (..., k, k); batched over leading dimensions."""
    Qn, R = torch.linalg.qr(Q)
    sign = torch.where(torch.diagonal(R, dim1=-2, dim2=-1) < 0, -1.0, 1.0).to(Q.dtype)
    return Qn * sign[..., None, :], R * sign[..., :, None]


def orth_against(Q0: Tensor, Y: Tensor) -> Tensor:
    """Orthonormal columns spanning (I − Q0 Q0ᵀ) Y: Q0 (..., m, r) orthonormal, Y (..., m, c)
    -> (..., m, c), batched; Q0 projected out twice (classical Gram–Schmidt, reorthogonalised),
    then a QR. It keeps all c columns, so Y must have full rank after the projection (the
    integrator's rank-revealing complement, which drops dependent directions, is
    :func:`rankwise.optim._step.orth_complement_fixed`)."""
    for _ in range(2):
        Y = Y - Q0 @ (Q0.mT @ Y)
    return torch.linalg.qr(Y)[0]


def batch_mm(A: Tensor, B: Tensor) -> Tensor:
    """A @ B for batches (N, ·, ·), a batch of one as one matrix product (torch's batched
    product is slower there)."""
    return A @ B if A.shape[0] > 1 else (A[0] @ B[0])[None]


def gram_rtol(dtype: torch.dtype, c: int) -> float:
    """The orthogonalisations' default relative threshold for a direction to count: √(4 eps)
    of `dtype` (the eigenvalues of the Gram matrix of unit columns rounded to `dtype` are noise
    up to about eps, and a direction kept from that noise is garbage: in float32 one at 1.6 eps
    broke the Cholesky factorisation after it), no smaller than what a float64 Gram matrix of
    c unit columns resolves."""
    gram_floor = (1e3 * max(c, 1) * torch.finfo(torch.float64).eps) ** 0.5
    return max((4 * torch.finfo(dtype).eps) ** 0.5, gram_floor)


def tail_count(s: Tensor, tol: Tensor | float) -> Tensor:
    """The tolerance rule: the smallest r with ``‖s[r:]‖₂ ≤ tol``, unclamped (0 when the whole
    ``‖s‖ ≤ tol``), for singular values s (..., k) in descending order and a tolerance broadcasting
    over the leading dimensions (a number, or a tensor (...,)). Returns (...,) int64."""
    sq = torch.cat([s.flip(-1).square().cumsum(-1).flip(-1), s.new_zeros(*s.shape[:-1], 1)], -1)
    tails = sq.clamp_min(0).sqrt()  # tails[..., i] = ‖s[..., i:]‖, tails[..., k] = 0: non-increasing
    tol = tol[..., None] if torch.is_tensor(tol) else tol
    return (tails > tol).sum(-1)


def tail_rank(s: Tensor, tol: float, *, min_rank: int = 1, max_rank: int | None = None) -> int:
    """Smallest rank r with ``sqrt(sum_{i>=r} s_i^2) <= tol`` (:func:`tail_count`), clamped to
    [min_rank, max_rank].

    ``s`` (k,) are singular values in descending order. The clamp never exceeds ``k``.
    """
    k = s.numel()
    hi = k if max_rank is None else min(k, max_rank)
    r = int(tail_count(s, tol))
    return max(min(r, hi), min(min_rank, hi))


def truncated_svd(
    W: Tensor, *, rank: int | None = None, tau: float | None = None
) -> tuple[Tensor, Tensor, Tensor]:
    """Truncated SVD ``W ~= U diag(s) V^T`` of a matrix (m, n), or of a batch (..., m, n) with
    ``rank`` alone (a tolerance would give every matrix its own rank).

    With ``rank`` the first ``rank`` triplets are kept; with ``tau`` the smallest rank whose
    discarded tail satisfies ``||tail||_F <= tau * ||W||_F``; with both, the smaller of the two.

    **Returns:** U (..., m, r), s (..., r), V (..., n, r).
    """
    if rank is None and tau is None:
        raise ValueError("give `rank` or `tau` (or both) for a truncated SVD")
    if tau is not None:
        check_unit_interval(tau, "tau")
        if W.dim() != 2:
            raise ValueError(f"`tau` needs a single matrix (m, n); got shape {tuple(W.shape)}")
    full = min(W.shape[-2:])
    if rank is not None and rank < 1:
        raise ValueError(f"`rank` must be >= 1; got {rank}")
    U, s, Vh = torch.linalg.svd(W, full_matrices=False)
    r = full if rank is None else min(rank, full)
    if tau is not None:
        r = min(r, tail_rank(s, tau * float(torch.linalg.vector_norm(s))))
    return U[..., :r], s[..., :r], Vh[..., :r, :].mT


def __dir__() -> list[str]:
    """The public names only (not this module's own imports)."""
    return list(__all__)
