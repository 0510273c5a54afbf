r"""The augmented-BUG step over a *group* of same-shape layers: batched, with no host reads.

The papers state the step for one layer, with shapes that follow the data (a
numerically dependent direction of ΔK is dropped, so Ū has as many columns as survive). That
is exact but needs the host to learn each shape, i.e. a device→host read per layer and
factorisation. Here the same step runs on N layers stacked along a leading dimension, with
shapes the host knows in advance:

- **fixed width**: ``Ū = [U0, U_buf, E_U]`` with E_U of ``w = min(c, m − k)`` columns (c the
  columns of ΔK, k those of [U0, U_buf]); a direction the eigen filter would drop is replaced
  by a fill direction (Ū stays orthonormal) whose row of the core is zero, so the core is the
  exact path's core bordered by zeros: the same singular values and, for every σ > 0, the
  same directions Ū P. Each layer's exact core size k travels with the plan, so ranks and
  buffer sizes are the exact path's.
- **ranks on the device**: the tolerance rule and its clamps are evaluated as tensors
  (:func:`tolerance_ranks`); the caller brings every layer's new rank, its buffer size, the
  drop flags and the finiteness flags to the host in one transfer.

Shapes: U0 (N, m, r0), V0 (N, n, r0), ΔK (N, m, r0), ΔL (N, n, r0), ΔS (N, r0, r0),
buffers (N, m, b), (N, n, b): N counts the layers of the group (L is always the factor V Sᵀ).
All functions are pure.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch import Tensor

from ..linalg import batch_mm as _mm
from ..linalg import gram_rtol, orthonormalize, tail_count
from ._integrators import Factors, reorthonormalize, thin_svd


class GroupPlan(NamedTuple):
    """One group's augmented step before its truncation: Ū (N, m, ku), V̄ (N, n, kv), the
    core S̄ (N, ku, kv) and its SVD P (N, ku, k), s (N, k), Q (N, kv, k); ``r0``: the old rank;
    ``k`` (N,) int64: each layer's core size as the exact path has it (min of its augmented
    bases' widths without fill directions); ``failed`` (N,) bool: the fixed-width augmentation
    failed (integrate that layer by the exact path); ``finite`` (N,) bool: S̄ is finite;
    ``new`` (N,) int64: the new directions the wider side kept (the width the next step needs)."""

    U: Tensor
    V: Tensor
    S: Tensor
    P: Tensor
    s: Tensor
    Q: Tensor
    r0: int
    k: Tensor
    failed: Tensor
    finite: Tensor
    new: Tensor
    mU: Tensor | None = None  # (N, ku) bool: Ū's columns that carry the step (False: a fill)
    mV: Tensor | None = None  # (N, kv) bool


def _sub_mm(X: Tensor, A: Tensor, B: Tensor) -> Tensor:
    """X − A @ B in one fused call (no temporary of X's size)."""
    if X.shape[0] == 1:
        return torch.addmm(X[0], A[0], B[0], alpha=-1)[None]
    return torch.baddbmm(X, A, B, alpha=-1)


FILL_SEED = 0x7F4A_7C15_9E37_79B9
"""The fill directions' seed. Not a seed users pick (0, 42, …): a basis drawn from the same
stream would contain the fill directions, which then cannot be orthogonal to it."""


def _fill(m: int, w: int, like: Tensor, fills: dict | None) -> Tensor:
    """A fixed Gaussian matrix (m, w) (seed :data:`FILL_SEED`, its own generator: the caller's
    random stream is not touched) to complete a basis where a direction was dropped. `fills`:
    the caller's cache (an optimizer keeps one, so that it draws each shape, dtype and device
    once); None: drawn for this call."""
    key = (m, w, like.dtype, like.device)
    if fills is not None and key in fills:
        return fills[key]
    gen = torch.Generator(device=like.device).manual_seed(FILL_SEED)
    out = torch.randn(m, w, generator=gen, device=like.device, dtype=like.dtype)
    if fills is not None:
        fills[key] = out
    return out


def orth_complement_fixed(Q0: Tensor, X: Tensor, *, rtol: float | Tensor | None = None,
                          width: int | None = None, extra: int = 0, robust: bool = False,
                          fills: dict | None = None) -> tuple[Tensor, Tensor, Tensor]:
    """Orthonormal columns spanning the part of span(X) orthogonal to span(Q0), at a width the
    host knows: Q0 (N, m, k) orthonormal, X (N, m, c) -> E (N, m, w), ``valid`` (N, w) bool,
    ``failed`` (N,) bool, with ``w = min(c, m − k, width)``. A `width` below the number of
    directions the filter keeps sets ``failed`` (the caller integrates that layer exactly).

    The one orthogonal complement of the step: X projected off Q0, the float64 Gram matrix of
    its columns scaled to unit length, its eigen filter (a direction whose singular value is
    ≤ `rtol`, default :func:`rankwise.linalg.gram_rtol`, relative to the original column norms
    is numerically dependent, or inside span(Q0), and dropped: no division by a singular value
    below `rtol`), a second projection and one Cholesky-QR pass. The valid directions come
    first (in ascending order of the filter's eigenvalues); the dropped ones (``valid`` False,
    always last) are not cut out but replaced by fixed random directions, orthonormalised in
    the same Cholesky-QR pass: E stays orthonormal and orthogonal to Q0, its valid columns
    span what the filter keeps, and the caller masks what the extra columns carry.
    ``failed``: the Cholesky factorisation did not succeed (E is unusable). X is first scaled
    by a power of two (exactly) so that its largest entry is in [0.5, 1): the Gram matrix
    stays inside the dtype's range and the span is unchanged. A non-finite X never reaches
    the eigen-decomposition (its Gram matrix is replaced by zeros): every direction of it is
    dropped (``valid`` all False, E its fill directions; the caller's finiteness checks of the
    update skip the step).

    Rank buckets: Q0 may hold zero columns (a layer padded to its group's width; they project
    nothing out), X zero columns (they count as dropped); `rtol` may then be a tensor (N,), each
    layer's threshold for its own column count. `extra` more fill columns, orthonormal to
    E and the non-zero columns of Q0, come after E (E then has ``w + extra`` columns): the
    caller puts them where Q0 has zero columns, so that Ū stays orthonormal. `robust`: where
    the Cholesky factorisation fails, E comes from a Householder QR instead (always computed:
    for the rare retry of a step, not for every step). `fills`: a cache of the fill directions
    (:func:`_fill`).
    """
    N, m, c = X.shape
    k = Q0.shape[-1]
    w = max(min(c, m - k, c if width is None else width), 0)
    X = X.to(Q0.dtype)
    if rtol is None:
        rtol = gram_rtol(X.dtype, c)
    tol2 = rtol**2 if not torch.is_tensor(rtol) else rtol.to(torch.float64).square()[:, None]
    if w == 0 and not extra:
        return X.new_zeros(N, m, 0), torch.zeros(N, 0, dtype=torch.bool, device=X.device), \
            torch.zeros(N, dtype=torch.bool, device=X.device)
    big = torch.linalg.vector_norm(X, float("inf"), dim=(-2, -1))  # NaN or inf: not finite
    finite = torch.isfinite(big)
    _, exp = torch.frexp(torch.where(finite & (big > 0), big, torch.ones_like(big)))
    X = torch.ldexp(X, -exp[:, None, None].to(X.dtype))  # exact: a power of two
    sq = torch.zeros(N, c, dtype=torch.float64, device=X.device)
    if k:
        C = _mm(Q0.mT, X)
        X = _sub_mm(X, Q0, C)
        sq = sq + C.double().square().sum(-2)
    G = _mm(X.mT, X).double()
    sq = sq + torch.diagonal(G, dim1=-2, dim2=-1)  # ‖x‖² = ‖Q0ᵀx‖² + ‖residual‖²
    # a non-finite X: its Gram matrix replaced (the eigen filter then drops every direction, and
    # its fill directions take the place of X M in Y)
    G = torch.where(finite[:, None, None], G, torch.zeros_like(G))
    sq = torch.where(finite[:, None], sq, torch.zeros_like(sq))
    d = torch.where(sq > 0, sq.clamp_min(1e-300).rsqrt(), torch.zeros_like(sq))
    lam, W = torch.linalg.eigh(G * d[..., :, None] * d[..., None, :])
    # more directions than a restricted width holds (beyond m − k they are roundoff: ignored)
    overflow = (lam > tol2).sum(-1) > (w if w < min(c, m - k) else c)
    lam, W = lam[..., c - w:].flip(-1), W[..., c - w:].flip(-1)  # the w largest, descending
    valid = lam > tol2
    # the e valid ones back in ascending order of their eigenvalues, fills after them
    j = torch.arange(w, device=X.device)
    e = valid.sum(-1, keepdim=True)
    order = torch.where(j < e, e - 1 - j, j)
    lam = lam.gather(-1, order)
    W = W.gather(-1, order[:, None, :].expand(-1, c, -1))
    inv = torch.where(valid, lam.clamp_min(tol2).rsqrt(), torch.zeros_like(lam))
    M = d[..., :, None] * W * inv[..., None, :]
    fill = _fill(m, w + extra, X, fills)
    Y = torch.where(valid[:, None, :], _mm(X, M.to(X.dtype)), fill[:, :w])
    if extra:
        Y = torch.cat([Y, fill[:, w:].expand(N, m, extra)], -1)
    if k:
        Y = _sub_mm(Y, Q0, _mm(Q0.mT, Y))
    Lc, info = torch.linalg.cholesky_ex(_mm(Y.mT, Y).double())
    E = torch.linalg.solve_triangular(Lc.to(Y.dtype), Y.mT, upper=False).mT
    if robust:
        E = torch.where((info != 0)[:, None, None], orthonormalize(Y)[0], E)
        return E, valid, overflow
    return E, valid, (info != 0) | overflow


def augment_group(U0: Tensor, V0: Tensor, dK: Tensor, dL: Tensor, U_buf: Tensor, V_buf: Tensor,
                  width: int | None = None, pad: Padding | None = None, robust: bool = False,
                  fills: dict | None = None) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """Ū = [U0, U_buf, E_U] (N, m, ku), V̄ = [V0, V_buf, E_V] (N, n, kv), the masks of their
    columns that carry the step (N, ku), (N, kv) (False: a fill direction of
    :func:`orth_complement_fixed`, or a padded column) and the layers' failure flags (N,): both
    sides in one call where their shapes agree (a square layer). With `pad` (layers of several
    ranks in one group, :class:`Padding`) the zero columns of [U0, U_buf] and [V0, V_buf] are
    replaced by orthonormal fill directions orthogonal to everything else in Ū, V̄."""
    Uk, Vk = torch.cat([U0, U_buf], -1), torch.cat([V0, V_buf], -1)
    extra, rtol = (0, None) if pad is None else (len(pad.slots), pad.rtol)
    if Uk.shape == Vk.shape and dK.shape == dL.shape:
        N = Uk.shape[0]
        rt = None if rtol is None else torch.cat([rtol, rtol])
        E, valid, failed = orth_complement_fixed(torch.cat([Uk, Vk]), torch.cat([dK, dL]), width=width,
                                                 extra=extra, rtol=rt, robust=robust, fills=fills)
        EU, EV, vU, vV, fU, fV = E[:N], E[N:], valid[:N], valid[N:], failed[:N], failed[N:]
    else:
        EU, vU, fU = orth_complement_fixed(Uk, dK, width=width, extra=extra, rtol=rtol, robust=robust,
                                           fills=fills)
        EV, vV, fV = orth_complement_fixed(Vk, dL, width=width, extra=extra, rtol=rtol, robust=robust,
                                           fills=fills)
    if pad is None:
        ones = torch.ones(Uk.shape[0], Uk.shape[-1], dtype=torch.bool, device=Uk.device)
        return (torch.cat([Uk, EU], -1), torch.cat([Vk, EV], -1), torch.cat([ones, vU], -1),
                torch.cat([ones, vV], -1), fU | fV)
    wU, wV = vU.shape[-1], vV.shape[-1]
    Uk, Vk = pad.fill(Uk, EU[..., wU:]), pad.fill(Vk, EV[..., wV:])
    return (torch.cat([Uk, EU[..., :wU]], -1), torch.cat([Vk, EV[..., :wV]], -1),
            torch.cat([pad.old, vU], -1), torch.cat([pad.old, vV], -1), fU | fV)


class Padding(NamedTuple):
    """How a group of layers of one shape and several ranks is padded to one width (rank
    buckets): each layer's [U0, U_buf] (N, m, R + B) holds its r columns, zeros up to R, its b
    buffer columns, zeros up to R + B. ``old`` (N, R + B) bool: the real columns; ``slots``:
    the column indices padded in some layer (host ints); ``rtol`` (N,): each layer's threshold
    of the eigen filter for its own r columns (:func:`rankwise.linalg.gram_rtol`)."""

    old: Tensor
    slots: list[int]
    rtol: Tensor
    index: Tensor  # the slots as a device index

    def fill(self, Q0: Tensor, F: Tensor) -> Tensor:
        """Q0 (N, m, R + B) with its zero columns replaced by the fill directions F (N, m,
        len(slots)), slot by slot."""
        keep = self.old.index_select(-1, self.index)[:, None, :]
        cols = torch.where(keep, Q0.index_select(-1, self.index), F)
        return Q0.index_copy(-1, self.index, cols)


def padding(ranks: list[int], buffers: list[int], dtype: torch.dtype, device: torch.device) -> Padding | None:
    """The :class:`Padding` of a group whose layers have these ranks and buffer sizes (None
    when they all agree: nothing is padded)."""
    R, B = max(ranks), max(buffers)
    if len(set(ranks)) == 1 and len(set(buffers)) == 1:
        return None
    rows = [[j < r for j in range(R)] + [j < b for j in range(B)]
            for r, b in zip(ranks, buffers, strict=True)]
    slots = [j for j in range(R + B) if not all(row[j] for row in rows)]
    old = torch.tensor(rows, dtype=torch.bool, device=device)
    rtol = torch.tensor([gram_rtol(dtype, r) for r in ranks], dtype=torch.float64, device=device)
    return Padding(old, slots, rtol, torch.tensor(slots, dtype=torch.int64, device=device))


def rank_bucket(r: int) -> int:
    """The rank bucket of rank r: the smallest power of two at least r (1, 2, 4, 8, 16, 32, …).
    Layers of one shape whose ranks share a bucket are integrated as one group, padded to the
    group's largest rank (at most twice a layer's own). Measured against a finer grid
    (2^j, 1.25·2^j, 1.5·2^j) in docs/lowrank.md: fewer groups, fewer ops."""
    return 1 << max(r - 1, 0).bit_length()


def tangent_blocks(r0: int, EU: Tensor, EV: Tensor, S: Tensor | None = None, K: Tensor | None = None,
                   L: Tensor | None = None) -> Tensor:
    r"""A tangent-space matrix M = U0 S V0ᵀ + (I − U0U0ᵀ) K V0ᵀ + U0 Lᵀ (I − V0V0ᵀ) in augmented
    coordinates Ūᵀ M V̄, Ū = [U0, E_U], V̄ = [V0, E_V] (E_U ⟂ U0, E_V ⟂ V0):
    ``[[S, Lᵀ E_V], [E_Uᵀ K, 0]]`` (N, r0 + a, r0 + b), in E_U's dtype. The one embedding of the
    step: the Galerkin core (S0 + ΔS, ΔK, ΔL), the two-pass S state (the moments), the gradient
    the sensitivity scores read (G_S, G_K, G_L), the augmented point (S0 alone).

    **Arguments:** `r0`: the old rank; `EU` (N, m, a), `EV` (N, n, b): the augmented bases'
    columns after the first r0; `S` (N, r0, r0), `K` (N, m, r0), `L` (N, n, r0): the blocks
    (None: zero)."""
    out = EU.new_zeros(EU.shape[0], r0 + EU.shape[-1], r0 + EV.shape[-1])
    if S is not None:
        out[:, :r0, :r0] = S
    if K is not None:
        out[:, r0:, :r0] = _mm(EU.mT, K)
    if L is not None:
        out[:, :r0, r0:] = _mm(L.mT, EV)
    return out


def core_group(U: Tensor, V: Tensor, S0: Tensor, dK: Tensor, dS: Tensor, dL: Tensor,
               mask_U: Tensor | None = None, mask_V: Tensor | None = None) -> Tensor:
    """The single-pass Galerkin core S̄ = S̄(0) + Ūᵀ ΔW V̄ (N, ku, kv), in blocks
    ``[[S0 + ΔS, ΔLᵀṼ], [ŨᵀΔK, 0]]`` (the tangent-space update ΔW = U0ΔSV0ᵀ + (I − U0U0ᵀ)ΔKV0ᵀ +
    U0ΔLᵀ(I − V0V0ᵀ) in the augmented bases: docs/lowrank.md, "One step, precisely"); the rows and
    columns of fill directions (masks False) are zero, as if those columns were not there."""
    r0 = S0.shape[-1]
    out = tangent_blocks(r0, U[..., r0:], V[..., r0:], S0 + dS, dK, dL)
    if mask_U is not None and mask_V is not None:
        out = out * (mask_U[:, :, None] & mask_V[:, None, :]).to(out.dtype)
    return out


def svd_gram(S: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """Thin SVD of a batch of cores S (N, k1, k2) through the float64 Gram matrix: SᵀS = Q Λ Qᵀ
    (one batched ``eigh``), σ = √λ, and P the orthonormal factor of the QR of S Q (which, for
    an exact SVD, only normalises S qᵢ = σᵢ pᵢ; for σ at roundoff level it completes P with
    orthonormal columns). cuSOLVER's default SVD is several times slower at these sizes.
    Returns P (N, k1, k), s (N, k), Q (N, k2, k), k = min(k1, k2), in the input's dtype."""
    k = min(S.shape[-2:])
    S64 = S.double()
    lam, W = torch.linalg.eigh(S64.mT @ S64)
    W = W.flip(-1)[..., :k]
    s = lam.flip(-1)[..., :k].clamp_min(0).sqrt()
    P, R = torch.linalg.qr(S64 @ W)
    sign = torch.where(torch.diagonal(R, dim1=-2, dim2=-1) < 0, -1.0, 1.0).to(P.dtype)
    return (P * sign[..., None, :]).to(S.dtype), s.to(S.dtype), W.to(S.dtype)


def svd_group(S: Tensor, method: str = "auto") -> tuple[Tensor, Tensor, Tensor]:
    """Thin SVD P (N, k1, k), s (N, k), Q (N, k2, k) of a batch of finite cores, in one call.
    `method`: ``"svd"`` (LAPACK / cuSOLVER's ``torch.linalg.svd``), ``"gram"``
    (:func:`svd_gram`) or ``"auto"``: ``"gram"`` for float32 cores on CUDA (its float64 Gram
    matrix resolves σ down to ~1e-8·σ_max, below float32's own roundoff), ``"svd"`` for float64
    cores (whose users want float64 accuracy) and on the CPU (LAPACK's SVD is the faster there:
    docs/lowrank.md, "Choices made on a measurement")."""
    if method == "auto":
        method = "gram" if S.is_cuda and S.dtype != torch.float64 else "svd"
    if method == "gram":
        return svd_gram(S)
    if method != "svd":
        raise ValueError(f"`method` must be 'auto', 'svd' or 'gram'; got {method!r}")
    return thin_svd(S)


def plan_group(U0: Tensor, S0: Tensor, V0: Tensor, dK: Tensor, dS: Tensor, dL: Tensor,
               U_buf: Tensor, V_buf: Tensor, *, width: int | None = None,
               pad: Padding | None = None, robust: bool = False, fills: dict | None = None) -> GroupPlan:
    """Augment, form the single-pass core and take its SVD for a group (shapes: module
    docstring; with `pad`, each layer padded to the group's rank and buffer width; the plan:
    :func:`sized_plan`). `width`: at most this many new directions per side (a layer that
    needs more is marked ``failed``); `fills`: :func:`_fill`'s cache."""
    U, V, mU, mV, failed = augment_group(U0, V0, dK, dL, U_buf, V_buf, width, pad, robust, fills)
    S = core_group(U, V, S0, dK, dS, dL, mU, mV)
    return sized_plan(U, V, S, S0.shape[-1], mU, mV, failed, U_buf.shape[-1] + S0.shape[-1])


def sized_plan(U: Tensor, V: Tensor, S: Tensor, r0: int, mU: Tensor, mV: Tensor, failed: Tensor,
               k0: int) -> GroupPlan:
    """The plan of a group's augmented core S (N, ku, kv): its SVD (:func:`svd_group`), each
    non-finite core replaced by zeros first (``finite`` says so: the factorisation never sees
    NaN), each layer's exact core size k = min(ku, kv) and its new directions (the wider
    side's), counted on the masks (k0: the padded width of [U0, U_buf])."""
    finite = torch.isfinite(S).all(-1).all(-1)
    P, s, Q = svd_group(torch.where(finite[:, None, None], S, torch.zeros_like(S)))
    kU, kV = mU.sum(-1), mV.sum(-1)
    new = torch.maximum(mU[:, k0:].sum(-1), mV[:, k0:].sum(-1))
    return GroupPlan(U, V, S, P, s, Q, r0, torch.minimum(kU, kV), failed, finite, new, mU, mV)


def tolerance_ranks(s: Tensor, tau: Tensor, min_rank: Tensor, max_rank: Tensor,
                    size: Tensor | None = None) -> Tensor:
    """The rank of each layer under its tolerance (N,) as the papers' rule picks
    it, on the device: the smallest r with ‖s[r:]‖ ≤ τ‖s‖ (at least 1), capped at the numerical
    rank (σ > k·eps·σ_max), then clamped to [min_rank, max_rank] and to [1, k]. s (N, kp)
    descending; `size` (N,): each layer's k (default kp; entries beyond it are zeros of fill
    directions). Returns (N,) int64."""
    N, k = s.shape
    size = torch.full((N,), k, device=s.device) if size is None else size
    if k == 0:
        return torch.zeros(N, dtype=torch.int64, device=s.device)
    tol = tau.to(torch.float64) * torch.linalg.vector_norm(s, dim=-1).double()
    r = tail_count(s, tol.to(s.dtype)).clamp(1, k)
    numerical = (s > s[:, :1] * (size[:, None].to(s.dtype) * torch.finfo(s.dtype).eps)).sum(-1)
    r = torch.minimum(r, numerical)
    r = torch.maximum(torch.minimum(r, max_rank), min_rank)
    return torch.minimum(r, size).clamp_min(1)


def masked_qr(X: Tensor, real: Tensor) -> tuple[Tensor, Tensor]:
    """Thin QR ``X = Q R`` (diag(R) > 0) of a batch X (N, m, k) whose columns where `real`
    (N, k) is False are zero: those columns stay zero in Q and are the identity in R (so R is
    invertible). Cholesky QR, twice, on the float64 Gram matrix: for the nearly orthonormal
    bases it is used on (re-orthonormalisation) it is as accurate as Householder QR."""
    Q, R = X, None
    pad = torch.diag_embed((~real).to(torch.float64))
    for _ in range(2):
        C = torch.linalg.cholesky(_mm(Q.mT, Q).double() + pad).mT  # upper
        Q = torch.linalg.solve_triangular(C.to(Q.dtype), Q, upper=True, left=False)
        R = C if R is None else C @ R
    return Q, R.to(X.dtype)


def reorthonormalize_group(f: Factors, pad: Padding | None) -> Factors:
    """:func:`._integrators.reorthonormalize` of a group; padded columns stay zero."""
    if pad is None:
        return reorthonormalize(f)
    return reorthonormalize(f, lambda X: masked_qr(X, pad.old))
