r"""The rank-adaptive augmented basis-update & Galerkin (BUG) step as pure functions.

One step for a layer ``W0 = U0 S0 V0ᵀ`` (U0 (m, r0), S0 (r0, r0), V0 (n, r0)) runs

1. **augment**: ``Ū = orth[U0, U_buf, ΔK]``, ``V̄ = orth[V0, V_buf, ΔL]``. ΔK and ΔL are the
   optimizer's updates of K = U S and L = V Sᵀ; span[U0, K1] = span[U0, ΔK] because
   K1 = U0 S0 + ΔK. U_buf, V_buf are SDLRT's compensation buffer (empty for DLRT); they are
   already orthonormal and orthogonal to U0, V0, so only ΔK, ΔL need orthogonalising.
2. **Galerkin core**: ``S̄(0) = (ŪᵀU0) S0 (V0ᵀV̄)``, which reconstructs W0 exactly, then
   ``S̄ = S̄(0) + ΔS̄`` with ΔS̄ the core update in the augmented coordinates.
3. **truncate**: ``S̄ = P Σ Qᵀ``; keep the smallest r1 with ``‖Σ[r1:]‖_F ≤ ϑ = τ ‖S̄‖_F``
   (Frobenius norms), clamped to [min_rank, max_rank]; ``U1 = Ū P[:, :r1]``,
   ``S1 = Σ[:r1]``, ``V1 = V̄ Q[:, :r1]``.
4. **buffer**: the next ``b = min(r1, k − r1)`` discarded directions mapped through the
   *augmented* (pre-truncation) bases: ``U_buf = Ū P[:, r1:r1+b]``, ``V_buf = V̄ Q[:, r1:r1+b]``.
   (The paper reuses U1, V1 for both the retained and the tail mapping, which is
   dimensionally wrong; the seed notes it.)

The step itself is batched over groups of layers (:mod:`.functional`, :mod:`._step`) and
checked against an independent float64 reference of steps 1–4 (``tests/reference_bug.py``);
here are the pieces it shares: the working copies (:class:`Factors`), their periodic
re-orthonormalisation and the core's SVD.

References: Ceruti, Kusch & Lubich, "A rank-adaptive robust integrator for dynamical low-rank
approximation" (BIT 2022); Schotthöfer et al., "Low-rank lottery tickets" (NeurIPS 2022);
the SDLRT seed (compensation buffer, τ ← ωτ feedback).
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch import Tensor

from ..linalg import orthonormalize


def thin_svd(S: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """Thin SVD ``S = P diag(s) Qᵀ`` (returns P, s, Q) of a core; the caller guarantees a
    finite S (k, l) or batch (..., k, l); retried in float64 if LAPACK's SVD does not converge."""
    try:
        P, s, Qh = torch.linalg.svd(S, full_matrices=False)
    except torch.linalg.LinAlgError:
        P, s, Qh = (t.to(S.dtype) for t in torch.linalg.svd(S.double(), full_matrices=False))
    return P, s, Qh.mT


class Factors(NamedTuple):
    """A layer's factors in working precision: U (m, r), S (r, r), V (n, r), gradients
    G_K (m, r), G_S (r, r), G_L (n, r), and the buffer U_buf (m, b), V_buf (n, b)."""

    U: Tensor
    S: Tensor
    V: Tensor
    G_K: Tensor
    G_S: Tensor
    G_L: Tensor
    U_buf: Tensor
    V_buf: Tensor


def reorthonormalize(f: Factors, qr=orthonormalize) -> Factors:
    """The same weight and gradients with exactly orthonormal ``[U, U_buf]`` and
    ``[V, V_buf]``: with ``U = U' R_U``, ``V = V' R_V`` (thin QR, R upper-triangular),
    ``S' = R_U S R_Vᵀ``, ``G_K' = G_K R_V⁻¹``, ``G_L' = G_L R_U⁻¹``,
    ``G_S' = R_U⁻ᵀ G_S R_V⁻¹`` (R is the identity up to the drift being removed). Also for
    a batch of layers stacked along a leading dimension. `qr`: the thin QR with diag(R) ≥ 0
    (a padded group passes one that leaves its zero columns zero)."""
    r = f.U.shape[-1]
    QU, RU = qr(torch.cat([f.U, f.U_buf], dim=-1))
    QV, RV = qr(torch.cat([f.V, f.V_buf], dim=-1))
    RU, RV = RU[..., :r, :r], RV[..., :r, :r]

    def right_solve(G: Tensor, R: Tensor) -> Tensor:  # G R⁻¹
        return torch.linalg.solve_triangular(R, G, upper=True, left=False)

    G_S = torch.linalg.solve_triangular(RU.mT, right_solve(f.G_S, RV), upper=False)
    return Factors(QU[..., :r], RU @ f.S @ RV.mT, QV[..., :r], right_solve(f.G_K, RV), G_S,
                   right_solve(f.G_L, RU), QU[..., r:], QV[..., r:])
