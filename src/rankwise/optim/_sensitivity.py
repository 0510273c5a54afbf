r"""What each singular direction of the augmented core is worth to the loss, as pure functions.

The spectral allocation rules (:mod:`._budget`) value a direction by the share of its layer's
norm it carries. ``Budget(allocation="sensitivity")`` values it by what removing it would cost
the loss instead (AdaLoRA's sensitivity, on DLRT's augmented core):

1. **The gradient in the augmented coordinates.** With Ū = [U0, E_U] (m, ku), V̄ = [V0, E_V]
   (n, kv) and G = ∂L/∂W, the integrator knows G_K = G V0, G_L = Gᵀ U0 and G_S = U0ᵀ G V0,
   so of Ḡ = Ūᵀ G V̄ it knows every block but E_Uᵀ G E_V (set to 0: the tangent-space
   projection of G, in augmented coordinates; :func:`._step.tangent_blocks`)::

       Ḡ = [[G_S, G_Lᵀ E_V], [E_Uᵀ G_K, 0]]                      (ku, kv)

2. **Per direction.** With S̄ = P diag(σ) Qᵀ, direction i carries σ_i p_i q_iᵀ; dropping it
   changes the loss by −σ_i ∂L/∂σ_i + O(σ_i²) with ∂L/∂σ_i = p_iᵀ Ḡ q_i, so its importance is
   ``I_i = |σ_i p_iᵀ Ḡ q_i|`` (AdaLoRA's |θ ∇θ| for the triplet's θ = σ_i).

3. **Smoothing across steps** (AdaLoRA: Ī ← β₁Ī + (1−β₁)I, Ū ← β₂Ū + (1−β₂)|I − Ī|). The
   directions rotate at every step, so the smoothed values of the old directions (the first
   r0 augmented coordinates) are carried to the new ones with the weights
   w_ji = ½(P_ji² + Q_ji²) (exact for a permutation; each column sums to at most 1). A new
   direction — one of the augmentation's, with no history (Σ_j w_ji = 0) — starts at its
   instantaneous importance instead of at (1−β₁)I: DLRT brings in new directions at every
   step, and an EMA from zero would rank every one of them below every old direction.

4. **The score** is ``Ī + Ū``, the smoothed importance plus its smoothed deviation (an upper
   estimate: a direction whose importance fluctuates is kept while it might matter).
   AdaLoRA's product Ī·Ū is not used: a direction with no history has Ū = 0 after the
   start in (3), and one whose importance is steady would score 0 however large it is.
   The allocator divides the score by what a direction costs (m + n parameters).
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch import Tensor


class Smoothed(NamedTuple):
    """Smoothed importance ``I`` and uncertainty ``U`` (k,) of a layer's directions, in the
    order of its current basis."""

    I: Tensor  # noqa: E741 (AdaLoRA's name)
    U: Tensor


def importance(P: Tensor, s: Tensor, Q: Tensor, G_bar: Tensor) -> Tensor:
    """``I_i = |σ_i p_iᵀ Ḡ q_i|`` (k,) for S̄ = P diag(s) Qᵀ, P (ku, k), Q (kv, k)."""
    return (s * ((P.mT @ G_bar) * Q.mT).sum(-1)).abs()


def smooth(prev: Smoothed | None, P: Tensor, Q: Tensor, inst: Tensor, *, beta1: float,
           beta2: float) -> Smoothed:
    """The smoothed importance and uncertainty of the k new directions (module docstring,
    step 3). `prev`: those of the r0 old directions (``None``: no history); `P` (ku, k),
    `Q` (kv, k): the SVD's coordinate maps, whose first r0 rows are the old directions;
    `inst` (k,): this step's :func:`importance`. Batches (a leading dimension on every
    argument) are taken as they are."""
    if prev is None or prev.I.shape[-1] == 0:
        return Smoothed(inst.clone(), torch.zeros_like(inst))
    r0 = prev.I.shape[-1]
    w = 0.5 * (P[..., :r0, :].square() + Q[..., :r0, :].square())  # (..., r0, k)
    seen = w.sum(-2).clamp(max=1.0)                                   # how much of each new direction is old
    I_old = (w * prev.I.to(inst)[..., :, None]).sum(-2)
    U_old = (w * prev.U.to(inst)[..., :, None]).sum(-2)
    I_new = beta1 * (I_old + (1 - seen) * inst) + (1 - beta1) * inst
    U_new = beta2 * U_old + (1 - beta2) * (inst - I_new).abs()
    return Smoothed(I_new, U_new)


def scores(sm: Smoothed) -> Tensor:
    """The score of each direction (k,): ``Ī + Ū`` (module docstring, step 4)."""
    return sm.I + sm.U
