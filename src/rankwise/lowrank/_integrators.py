r"""The rank-adaptive augmented basis-update & Galerkin (BUG) step as pure functions.

One step for a layer ``W0 = U0 S0 V0ᵀ`` (U0 (m, r0), S0 (r0, r0), V0 (n, r0)) runs

1. **augment**: ``Ū = orth[U0, ΔK, U_buf]``, ``V̄ = orth[V0, ΔL, V_buf]``. ΔK and ΔL are the
   optimizer's updates of K = U S and L = V Sᵀ; span[U0, K1] = span[U0, ΔK] because
   K1 = U0 S0 + ΔK. U_buf, V_buf are SDLRT's compensation buffer (empty for DLRT).
2. **Galerkin core**: ``S̄(0) = (ŪᵀU0) S0 (V0ᵀV̄)``, which reconstructs W0 exactly, then
   ``S̄ = S̄(0) + ΔS̄`` with ΔS̄ the core update in the augmented coordinates.
3. **truncate**: ``S̄ = P Σ Qᵀ``; keep the smallest r1 with ``‖Σ[r1:]‖_F ≤ ϑ = τ ‖S̄‖_F``
   (Frobenius norms), clamped to [min_rank, max_rank]; ``U1 = Ū P[:, :r1]``,
   ``S1 = Σ[:r1]``, ``V1 = V̄ Q[:, :r1]``.
4. **buffer**: the next ``b = min(r1, k − r1)`` discarded directions mapped through the
   *augmented* (pre-truncation) bases: ``U_buf = Ū P[:, r1:r1+b]``, ``V_buf = V̄ Q[:, r1:r1+b]``.
   (The paper reuses U1, V1 for both the retained and the tail mapping, which is
   dimensionally wrong; the seed notes it.)

References: Ceruti, Kusch & Lubich, "A rank-adaptive robust integrator for dynamical low-rank
approximation" (BIT 2022); Schotthöfer et al., "Low-rank lottery tickets" (NeurIPS 2022);
the SDLRT seed (compensation buffer, τ ← ωτ feedback).
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch import Tensor

from ..linalg import orth_extend, tail_rank


class Augmented(NamedTuple):
    """Augmented bases Ū (m, ku), V̄ (n, kv) and the old-to-augmented coordinate maps
    ``A = ŪᵀU0`` (ku, r0) and ``B = V0ᵀV̄`` (r0, kv)."""

    U: Tensor
    V: Tensor
    A: Tensor
    B: Tensor


class Truncated(NamedTuple):
    """New factors U (m, r1), S (r1, r1), V (n, r1); buffer U_buf (m, b), V_buf (n, b);
    ``P`` (ku, r1), ``Q`` (kv, r1): augmented-to-new coordinate maps."""

    U: Tensor
    S: Tensor
    V: Tensor
    U_buf: Tensor
    V_buf: Tensor
    P: Tensor
    Q: Tensor


def augment(U0: Tensor, V0: Tensor, dK: Tensor, dL: Tensor,
            U_buf: Tensor | None = None, V_buf: Tensor | None = None) -> Augmented:
    """Step 1: orthonormal augmented bases (numerically dependent columns dropped)."""
    U = orth_extend(U0, dK, *([] if U_buf is None else [U_buf]))
    V = orth_extend(V0, dL, *([] if V_buf is None else [V_buf]))
    return Augmented(U, V, U.mT @ U0, V0.mT @ V)


def galerkin_core(aug: Augmented, S0: Tensor) -> Tensor:
    """Step 2a: ``S̄(0) = (ŪᵀU0) S0 (V0ᵀV̄)``, so that ``Ū S̄(0) V̄ᵀ = U0 S0 V0ᵀ``."""
    return aug.A @ S0 @ aug.B


def projected_update(aug: Augmented, U0: Tensor, V0: Tensor,
                     dK: Tensor, dS: Tensor, dL: Tensor) -> Tensor:
    r"""Step 2b, single pass: the core update in augmented coordinates, ``Ūᵀ ΔW V̄`` with

    ``ΔW = U0 ΔS V0ᵀ + (I − U0U0ᵀ) ΔK V0ᵀ + U0 ΔLᵀ (I − V0V0ᵀ)``,

    the tangent-space update assembled from the K, S, L updates. For plain SGD it is −lr
    times the gradient projected onto the tangent space at W0, i.e. the one gradient of the
    single pass projected onto the augmented bases (the block of the augmented core that
    couples the two new subspaces is the one a second pass would add).
    dK (m, r0), dS (r0, r0), dL (n, r0); returns (ku, kv).
    """
    A, B = aug.A, aug.B
    left = aug.U.mT @ dK - A @ (U0.mT @ dK)   # Ūᵀ (I − U0U0ᵀ) ΔK   (ku, r0)
    right = dL.mT @ aug.V - (dL.mT @ V0) @ B  # ΔLᵀ (I − V0V0ᵀ) V̄   (r0, kv)
    return A @ dS @ B + left @ B + A @ right


def truncate(aug: Augmented, S_bar: Tensor, *, tau: float | None = None, rank: int | None = None,
             min_rank: int = 1, max_rank: int | None = None, buffer: bool = False) -> Truncated:
    """Steps 3–4: SVD of the small core, truncation and, with ``buffer``, the new buffer.

    With ``rank`` the rank is fixed (fixed-rank BUG), otherwise chosen by the tolerance
    ϑ = τ‖S̄‖_F and capped at the numerical rank (σ > k·eps·σ_max); then clamped to
    [min_rank, max_rank] and to the core size k. The discarded tail is ≤ max(ϑ, roundoff).
    """
    if (tau is None) == (rank is None):
        raise ValueError("give exactly one of `tau` (adaptive) or `rank` (fixed)")
    P, s, Qh = torch.linalg.svd(S_bar, full_matrices=False)
    Q = Qh.mT
    k = s.numel()
    if rank is not None:
        r1 = rank
    else:
        # Directions at roundoff level (σ ≤ k·eps·σ_max) are never kept, however small τ has
        # become: SDLRT's feedback can drive τ to 0, and the rank would then fill with noise.
        numerical = int((s > s[0] * k * torch.finfo(s.dtype).eps).sum()) if k else 0
        r1 = min(tail_rank(s, tau * float(torch.linalg.vector_norm(s))), numerical)
        r1 = max(min(r1, max_rank if max_rank is not None else k), min_rank)
    r1 = max(1, min(r1, k))
    b = min(r1, k - r1) if buffer else 0
    return Truncated(
        U=aug.U @ P[:, :r1], S=torch.diag(s[:r1]), V=aug.V @ Q[:, :r1],
        U_buf=aug.U @ P[:, r1:r1 + b], V_buf=aug.V @ Q[:, r1:r1 + b],
        P=P[:, :r1], Q=Q[:, :r1],
    )
