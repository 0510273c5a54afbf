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

The optimizer does not call the one-layer step here (``augment`` … ``truncate``): it takes the
batched one of :mod:`.functional` and :mod:`._step`, checked against an independent float64
reference in ``tests/reference_bug.py``; what it uses from here are :class:`Factors`,
:func:`reorthonormalize` and :func:`thin_svd`. The rest states the step for one layer in its
plainest form, with its properties tested (``tests/test_integrators.py``).

References: Ceruti, Kusch & Lubich, "A rank-adaptive robust integrator for dynamical low-rank
approximation" (BIT 2022); Schotthöfer et al., "Low-rank lottery tickets" (NeurIPS 2022);
the SDLRT seed (compensation buffer, τ ← ωτ feedback).
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from typing import NamedTuple

import torch
from torch import Tensor

from ..linalg import one_thread, orth_complement_batched, orthonormalize, tail_rank


class Augmented(NamedTuple):
    """Augmented bases Ū = [U0, U_buf, E_U] (m, ku) and V̄ = [V0, V_buf, E_V] (n, kv); their
    first ``r0`` columns are the old bases (so ŪᵀU0 = I[:, :r0] and V0ᵀV̄ = I[:r0, :])."""

    U: Tensor
    V: Tensor
    r0: int


class Truncated(NamedTuple):
    """New factors U (m, r1), S (r1, r1), V (n, r1); buffer U_buf (m, b), V_buf (n, b);
    ``P`` (ku, r1), ``Q`` (kv, r1): augmented-to-new coordinate maps (so the old-to-new maps
    are ``U0ᵀU1 = P[:r0]`` and ``V0ᵀV1 = Q[:r0]``)."""

    U: Tensor
    S: Tensor
    V: Tensor
    U_buf: Tensor
    V_buf: Tensor
    P: Tensor
    Q: Tensor


def augment(U0: Tensor, V0: Tensor, dK: Tensor, dL: Tensor,
            U_buf: Tensor | None = None, V_buf: Tensor | None = None) -> Augmented:
    """Step 1: ``Ū = [U0, U_buf, orth((I − P)ΔK)]`` and likewise V̄.

    ``[U0, U_buf]`` must be orthonormal — true for the buffer this integrator produces (it
    comes from the same SVD as the retained basis); the optimizer re-orthonormalises
    periodically. Only ΔK (m, r0) and ΔL (n, r0) are orthogonalised (numerically dependent
    directions dropped).
    """
    return augment_many([(U0, V0, dK, dL, U_buf, V_buf)])[0]


BATCH_WORK = 2**24
"""Orthogonalisations with more multiply-adds than this per pair (m·(k + c)·c for a basis
(m, k) and an update (m, c)) run one by one: there the per-call cost is negligible and torch's
batched matrix product is slower than single ones (measured on 2 CPU cores: a batch of 8
pairs at m = 2048, k = c = 195 took 1.14× the loop; at m = 1024, k = c = 52, 0.78×; at
m = 384, k = c = 19, 0.31×)."""


class NonFiniteUpdate(FloatingPointError):
    """An update (ΔK or ΔL) with non-finite entries; ``index``: the first such layer."""

    def __init__(self, message: str, index: int):
        super().__init__(message)
        self.index = index


def augment_many(layers: Sequence[tuple[Tensor, Tensor, Tensor, Tensor, Tensor | None, Tensor | None]],
                 keys: Sequence[Hashable] | None = None) -> list[Augmented]:
    """:func:`augment` of many layers, each given as ``(U0, V0, ΔK, ΔL, U_buf, V_buf)``.

    Every orthogonalisation whose inputs have one shape, dtype and device (both sides of a
    square layer, all the layers of a transformer block's width) runs in one batch
    (:func:`~rankwise.linalg.orth_complement_batched`): for small layers most of the cost
    of :func:`augment` is per call, not arithmetic (large ones, above :data:`BATCH_WORK`,
    run alone). Batches are formed in the order of
    `layers`, within equal `keys` (default: one key), so equal inputs and keys give bitwise
    equal results. Raises :class:`NonFiniteUpdate` naming the first layer whose ΔK or ΔL is
    not finite.
    """
    keys = [None] * len(layers) if keys is None else list(keys)
    if len(keys) != len(layers):
        raise ValueError(f"got {len(keys)} keys for {len(layers)} layers")
    bases, batches = [], {}
    for i, (U0, V0, dK, dL, U_buf, V_buf) in enumerate(layers):
        Uk = U0 if U_buf is None else torch.cat([U0, U_buf], dim=1)
        Vk = V0 if V_buf is None else torch.cat([V0, V_buf], dim=1)
        bases.append([Uk, Vk])
        for side, (Q0, X) in enumerate(((Uk, dK), (Vk, dL))):
            (m, k), c = Q0.shape, X.shape[1]
            alone = (i, side) if m * (k + c) * c > BATCH_WORK else None
            key = (keys[i], alone, tuple(Q0.shape), tuple(X.shape), Q0.dtype, X.dtype, Q0.device)
            batches.setdefault(key, []).append((i, side, Q0, X))
    new: dict[tuple[int, int], Tensor] = {}
    for members in batches.values():
        try:
            out = orth_complement_batched(torch.stack([m[2] for m in members]),
                                          torch.stack([m[3] for m in members]))
        except FloatingPointError as e:
            bad = next((i for i, item in enumerate(layers)
                        if not (bool(torch.isfinite(item[2]).all()) and bool(torch.isfinite(item[3]).all()))),
                       None)
            if bad is None:  # finite in its own dtype, not in the bases' (a cast overflowed)
                cast = members[0][2].dtype
                raise NonFiniteUpdate(f"{e} (after casting to {cast})", members[0][0]) from None
            raise NonFiniteUpdate("orth_complement: X has non-finite entries", bad) from None
        for (i, side, _, _), E in zip(members, out, strict=True):
            new[i, side] = E
    return [Augmented(torch.cat([Uk, new[i, 0]], dim=1), torch.cat([Vk, new[i, 1]], dim=1),
                      layers[i][0].shape[1]) for i, (Uk, Vk) in enumerate(bases)]


def galerkin_core(aug: Augmented, S0: Tensor) -> Tensor:
    """Step 2a: ``S̄(0) = (ŪᵀU0) S0 (V0ᵀV̄)`` = S0 padded with zeros to (ku, kv), so that
    ``Ū S̄(0) V̄ᵀ = U0 S0 V0ᵀ``."""
    r0 = aug.r0
    S = S0.new_zeros(aug.U.shape[1], aug.V.shape[1])
    S[:r0, :r0] = S0
    return S


def projected_update(aug: Augmented, dK: Tensor, dS: Tensor, dL: Tensor) -> Tensor:
    r"""Step 2b, single pass: the core update in augmented coordinates, ``Ūᵀ ΔW V̄`` with

    ``ΔW = U0 ΔS V0ᵀ + (I − U0U0ᵀ) ΔK V0ᵀ + U0 ΔLᵀ (I − V0V0ᵀ)``,

    the tangent-space update assembled from the K, S, L updates. For plain SGD it is −lr
    times the gradient projected onto the tangent space at W0: the one gradient of the single
    pass projected onto the augmented bases. In blocks (Ũ = Ū[:, r0:], Ṽ = V̄[:, r0:]):
    ``[[ΔS, ΔLᵀṼ], [ŨᵀΔK, 0]]`` — the zero block is what a second pass would fill.
    dK (m, r0), dS (r0, r0), dL (n, r0); returns (ku, kv).
    """
    r0 = aug.r0
    out = galerkin_core(aug, dS)
    out[r0:, :r0] = aug.U[:, r0:].mT @ dK
    out[:r0, r0:] = dL.mT @ aug.V[:, r0:]
    return out


def truncate(aug: Augmented, S_bar: Tensor, *, tau: float | None = None, rank: int | None = None,
             min_rank: int = 1, max_rank: int | None = None, buffer: bool = False,
             svd: tuple[Tensor, Tensor, Tensor] | None = None) -> Truncated:
    """Steps 3–4: SVD of the small core, truncation and, with ``buffer``, the new buffer.

    With ``rank`` the rank is fixed (fixed-rank BUG, or a rank chosen by a budget), otherwise
    chosen by the tolerance ϑ = τ‖S̄‖_F and capped at the numerical rank
    (σ > k·eps·σ_max); then clamped to [min_rank, max_rank] and to the core size k. The
    discarded tail is ≤ max(ϑ, roundoff). ``svd``: S̄'s SVD (P, s, Q) if already computed.
    """
    if (tau is None) == (rank is None):
        raise ValueError("give exactly one of `tau` (adaptive) or `rank` (fixed)")
    P, s, Q = core_svd(S_bar) if svd is None else svd
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
    U, V = aug.U @ P[:, :r1 + b], aug.V @ Q[:, :r1 + b]  # retained and buffer in one product
    return Truncated(U=U[:, :r1], S=torch.diag(s[:r1]), V=V[:, :r1], U_buf=U[:, r1:], V_buf=V[:, r1:],
                     P=P[:, :r1], Q=Q[:, :r1])


def core_svd(S: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """Thin SVD ``S = P diag(s) Qᵀ`` (returns P, s, Q) of a core (k, l) or a batch (..., k, l).
    LAPACK's divide-and-conquer SVD occasionally fails to converge on finite matrices; retry
    once in float64."""
    if not bool(torch.isfinite(S).all()):
        raise FloatingPointError("the augmented core S̄ is not finite; no weights were changed")
    return thin_svd(S)


def thin_svd(S: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """:func:`core_svd` without its finiteness check (no host read): the caller guarantees a
    finite S (k, l) or batch (..., k, l); on one thread, retried in float64 if LAPACK's SVD
    does not converge."""
    with one_thread():  # a small factorisation: see rankwise.linalg.one_thread
        try:
            P, s, Qh = torch.linalg.svd(S, full_matrices=False)
        except torch.linalg.LinAlgError:
            P, s, Qh = (t.to(S.dtype) for t in torch.linalg.svd(S.double(), full_matrices=False))
    return P, s, Qh.mT


def core_svd_many(cores: Sequence[Tensor], keys: Sequence[Hashable] | None = None
                  ) -> list[tuple[Tensor, Tensor, Tensor]]:
    """:func:`core_svd` of many cores; those of one shape, dtype and device (and equal `keys`)
    in one batched call, formed in the order given (so equal inputs give bitwise equal
    results)."""
    keys = [None] * len(cores) if keys is None else list(keys)
    batches: dict = {}
    for i, S in enumerate(cores):
        batches.setdefault((keys[i], tuple(S.shape), S.dtype, S.device), []).append(i)
    out: list = [None] * len(cores)
    for idx in batches.values():
        if len(idx) == 1:
            out[idx[0]] = core_svd(cores[idx[0]])
            continue
        P, s, Q = core_svd(torch.stack([cores[i] for i in idx]))
        for j, i in enumerate(idx):
            out[i] = (P[j], s[j], Q[j])
    return out


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
