"""Small shared numerics: pure functions on tensors.

Everything here is dtype-agnostic and never divides by a singular value without a guard.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from ._checks import check_unit_interval

__all__ = ["batch_mm", "gram_rtol", "orth_against", "orth_complement",
           "orth_complement_batched",
           "orthonormalize", "tail_count", "tail_rank", "truncated_svd", "work_dtype"]


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
    then a QR. Unlike :func:`orth_complement` it keeps all c columns (a batch needs one shape),
    so Y must have full rank after the projection."""
    for _ in range(2):
        Y = Y - Q0 @ (Q0.mT @ Y)
    return torch.linalg.qr(Y)[0]


def orth_complement(Q0: Tensor, X: Tensor, *, rtol: float | None = None) -> Tensor:
    """Orthonormal basis (m, e) of the part of ``span(X)`` orthogonal to ``span(Q0)``.

    ``Q0`` (m, r) must have orthonormal columns (r may be 0); ``X`` is (m, c). X is projected
    off Q0 and the range of the residual is read from the eigen-decomposition of its Gram
    matrix (float64), scaled as if every column of X had unit length: directions whose
    singular value is ≤ ``rtol`` relative to the original column norms are numerically
    dependent (or inside span(Q0)) and dropped — no division by a singular value below
    ``rtol`` ever happens. The result is projected off Q0 once more and re-orthonormalised by
    one Cholesky-QR pass. All heavy work is matrix products plus (c×c) factorisations, which
    is several times faster than a Householder QR of the tall matrix on few cores.

    `rtol` defaults to :func:`gram_rtol`: ``max(sqrt(4 eps), sqrt(1e3·c·eps64))``, but no
    smaller than what a float64 Gram matrix can resolve. A batch of same-shape pairs:
    :func:`orth_complement_batched`.
    """
    if X.dim() != 2 or Q0.dim() != 2:
        raise ValueError(f"Q0 and X must be matrices; got shapes {tuple(Q0.shape)} and {tuple(X.shape)}")
    if X.shape[0] != Q0.shape[0]:
        raise ValueError(f"X must have {Q0.shape[0]} rows like Q0; got {X.shape[0]}")
    return orth_complement_batched(Q0[None], X[None], rtol=rtol)[0]


def batch_mm(A: Tensor, B: Tensor) -> Tensor:
    """A @ B for batches (L, ·, ·), a batch of one as one matrix product (torch's batched
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


def orth_complement_batched(Q0: Tensor, X: Tensor, *, rtol: float | None = None) -> list[Tensor]:
    """:func:`orth_complement` of each pair of a batch, in one call per step of the algorithm:
    Q0 (L, m, r), X (L, m, c) -> L bases (m, e_i) (e_i may differ: each drops its own
    dependent directions). For many small layers of one shape this removes most of the
    per-call cost (25 small torch operations per pair). Results agree with the unbatched
    function to roundoff; bitwise they depend on the batch (LAPACK and the batched matrix
    product take other code paths for other batch sizes and memory offsets), so a caller
    that must be reproducible forms its batches the same way each time.

    Raises ``FloatingPointError`` naming the first pair whose X is not finite.
    """
    L, m, c = X.shape
    mm = batch_mm
    if Q0.dim() != 3 or Q0.shape[:2] != (L, m):
        raise ValueError(f"X (L, m, c) = {tuple(X.shape)} needs Q0 (L, m, r) with the same L and m; "
                         f"got {tuple(Q0.shape)}")
    X = X.to(Q0.dtype)
    if rtol is None:
        rtol = gram_rtol(X.dtype, c)
    if X.numel() == 0:
        return [X.new_zeros(m, 0) for _ in range(L)]
    big = X.abs().amax(dim=(-2, -1)).tolist()
    for i, b in enumerate(big):
        if not math.isfinite(b):
            where = f" (pair {i})" if L > 1 else ""
            raise FloatingPointError(f"orth_complement: X has non-finite entries{where}")
    scale = [i for i, b in enumerate(big) if b > 1e15 or 0.0 < b < 1e-15]
    if scale:  # keep the Gram matrix X^T X inside the dtype's range
        X = X.clone()
        for i in scale:
            X[i] = X[i] / big[i]
    sq_norms = torch.zeros(L, c, dtype=torch.float64, device=X.device)
    if Q0.shape[-1]:
        C = mm(Q0.mT, X)
        X = X - mm(Q0, C)
        sq_norms += C.double().square().sum(-2)
    G = mm(X.mT, X).double()
    sq_norms += torch.diagonal(G, dim1=-2, dim2=-1)  # ‖x‖² = ‖Q0ᵀx‖² + ‖residual‖²
    d = torch.where(sq_norms > 0, sq_norms.rsqrt(), torch.zeros_like(sq_norms))
    lam, W = torch.linalg.eigh(G * d[..., :, None] * d[..., None, :])  # Gram of unit-length columns
    kept = (lam > rtol**2).sum(-1).tolist()  # eigenvalues ascend: the kept ones are the last e
    out: list[Tensor] = [X.new_zeros(m, 0)] * L
    for e in sorted(set(kept) - {0}):
        idx = [i for i, k in enumerate(kept) if k == e]
        sel = slice(None) if len(idx) == L else torch.tensor(idx, device=X.device)
        Xs, Q0s = X[sel], Q0[sel]
        M = d[sel][..., :, None] * W[sel][..., c - e:] * lam[sel][..., None, c - e:].rsqrt()
        Y = mm(Xs, M.to(X.dtype))
        if Q0.shape[-1]:
            Y = Y - mm(Q0s, mm(Q0s.mT, Y))
        Lc, info = torch.linalg.cholesky_ex(mm(Y.mT, Y).double())
        E = torch.linalg.solve_triangular(Lc.to(Y.dtype), Y.mT, upper=False).mT
        for j, i in enumerate(idx):  # a failed Cholesky is not expected after the eigen filter
            out[i] = E[j] if int(info[j]) == 0 else orthonormalize(Y[j])[0]
    return out


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
