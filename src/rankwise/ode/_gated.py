r"""A sequence classifier on a low-rank matrix memory: a GRU-ODE on the memory's p×p core.

The memory F (B, m, n) is kept as X S Vᵀ and read through two learned orthonormal frames,
P (m, p) and T (n, p): its core is c = Pᵀ F T (B, p, p). Step i of the sequence holds the
inputs x_i = (u_{i−w+1}, …, u_i) (zeros before the start) and

.. math::

    z = σ(A_z c B_zᵀ + W_z(x_i) + b_z + Z_z[i]),\quad
    n = \tanh(A_n c B_nᵀ + W_n(x_i) + b_n + Z_n[i]),

    \frac{dF}{dt} = −λ F + P\,(λ c + z ⊙ (n − c))\,Tᵀ,

so the core follows the GRU-ODE dc/dt = z ⊙ (n − c) (De Brouwer et al., 2019) with the input as
its drive, and whatever of F lies outside the frames decays at rate λ. The gates read the core
through A_g c B_gᵀ (``recurrence="kron"``: a Kronecker-structured map, 2p² numbers per gate) or
through a full linear map U_g vec(c) (``"full"``: p⁴ per gate, what a GRU of p² units has; on
mnist1d it is the difference between 0.80 and GRU level, docs/ode.md). W(x) = Σ_k x_k W[k] with
one W (w, p, p) for all steps, or one per step (`position_weights`; useful where positions carry
no order, as for permuted pixels). Every term acts on the factors: c = (Pᵀ K)(Vᵀ T) from K = X S,
so a KSL step costs O((m + n)·r·p + p³) per sample, never O(m·n).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor, nn

from ..linalg import orthonormalize
from ._block import LowRankODEBlock
from ._controller import AbstractController
from ._field import BoundField
from ._state import LowRankState

RECURRENCES = ("kron", "full")  # how the gates read the core: A c Bᵀ, or a full map of vec(c)


def _versions(*params: Tensor) -> tuple[int, ...]:
    """What identifies the values of `params` for a no-grad cache: an in-place update (an
    optimizer step) or a new tensor changes it; an update through ``.data`` does not."""
    return tuple(x for p in params for x in (id(p), p._version, p.data_ptr()))


class GatedMemoryField(BoundField):
    """The gated field above, driven by the sequence set with :meth:`set_input`.

    **Arguments:**
    - `m`, `n`: the memory's shape; `p` (≤ m, n): the core's size.
    - `steps`, `h`: the sequence length and the step the block integrates with: at time t the
      field reads element i = ⌊t/h⌋ (clamped to the last). A KSL step from t = i·h evaluates
      its K- and L-substeps at t; its S-substep at t (``s_time="start"``: step i reads
      element i only, causal) or at t + h (``"end"``: step i's S-substep reads element i + 1,
      so the model sees one element ahead).
    - `window`: inputs u_{i−w+1..i} each step sees; `position_weights`: one input map per step.
    - `decay`: λ. `generator`, `dtype`: of the initial parameters.
    - `recurrence`: how the gates read the core: ``"kron"`` (A c Bᵀ) or ``"full"`` (U vec(c)).
    """

    def __init__(self, m: int, n: int, p: int, *, steps: int, h: float, window: int = 1,
                 position_weights: bool = False, decay: float = 1.0, recurrence: str = "kron",
                 generator: torch.Generator | None = None, dtype: torch.dtype = torch.float32) -> None:
        super().__init__()
        if recurrence not in RECURRENCES:
            raise ValueError(f"`recurrence` must be one of {', '.join(map(repr, RECURRENCES))}; "
                             f"got {recurrence!r}")
        if not 1 <= p <= min(m, n) or min(steps, window) < 1 or not h > 0 or not decay >= 0:
            raise ValueError(f"need 1 <= p <= min(m, n), steps >= 1, window >= 1, h > 0, decay >= 0; got "
                             f"m={m}, n={n}, p={p}, steps={steps}, window={window}, h={h}, decay={decay}")

        def rand(*shape: int) -> Tensor:
            return torch.randn(*shape, generator=generator, dtype=dtype)

        self.steps, self.h, self.window, self.decay = steps, h, window, decay
        self.P = nn.Parameter(orthonormalize(rand(m, p))[0])
        self.T = nn.Parameter(orthonormalize(rand(n, p))[0])
        self.recurrence = recurrence
        if recurrence == "kron":  # both start near the identity: the gates first read c itself
            eye = torch.eye(p, dtype=dtype)
            self.A = nn.Parameter(torch.stack([eye + 0.1 * rand(p, p) / p**0.5 for _ in range(2)]))  # (z, n)
            self.B = nn.Parameter(torch.stack([eye + 0.1 * rand(p, p) / p**0.5 for _ in range(2)]))
        else:
            eye = torch.eye(p * p, dtype=dtype)
            self.U = nn.Parameter(torch.stack([eye + 0.1 * rand(p * p, p * p) / p for _ in range(2)]))
        shape = (steps, window) if position_weights else (window,)
        self.W = nn.Parameter(rand(2, *shape, p, p) / window**0.5)
        self.b = nn.Parameter(torch.stack([torch.full((p, p), -1.0, dtype=dtype),  # z starts near 0.27
                                           torch.zeros(p, p, dtype=dtype)]))
        self.Z = nn.Parameter(0.1 * rand(2, steps, p, p))
        self._u: Tensor | None = None
        self._frames: tuple[tuple, tuple[Tensor, Tensor]] | None = None  # no-grad caches: (key, value)
        self._drives: tuple[tuple, Tensor] | None = None  # (one step's: its K-, S- and L-substeps share it)
        self._inputs = 0  # counts set_input calls (part of the drive cache's key)

    def set_input(self, u: Tensor) -> None:
        """The sequence the next integrations read: u (B, steps); held as data (no gradient)."""
        if u.dim() != 2 or u.shape[1] != self.steps:
            raise ValueError(f"`u` must be (batch, {self.steps}); got {tuple(u.shape)}")
        self._u = nn.functional.pad(u.detach().to(self.P), (self.window - 1, 0))
        self._inputs += 1

    def frames(self) -> tuple[Tensor, Tensor]:
        """The orthonormal frames P (m, p), T (n, p). Without autograd (the reverse pass's
        fixed-point iterations) they are computed once per parameter update: an in-place update
        of P or T (an optimizer step) renews them; one through ``.data`` is not seen."""
        if torch.is_grad_enabled():
            return orthonormalize(self.P)[0], orthonormalize(self.T)[0]
        key = _versions(self.P, self.T)
        if self._frames is None or self._frames[0] != key:
            self._frames = key, (orthonormalize(self.P)[0], orthonormalize(self.T)[0])
        return self._frames[1]

    def core(self, state: LowRankState) -> Tensor:
        """c = Pᵀ X S Vᵀ T (B, p, p): what the classifier's head reads."""
        P, T = self.frames()
        return (P.mT @ state.X) @ state.S @ (state.V.mT @ T)

    def _drive(self, t: float) -> Tensor:
        """W(x_i) + b + Z[i] (2, B, p, p): the gates' terms that do not depend on the memory
        (z's, then n's), at time t. Without autograd the last one is kept (the substeps of a
        step read the same element), keyed like :meth:`frames`'s cache and by the input."""
        if self._u is None:
            raise RuntimeError("GatedMemoryField has no input; call set_input(u) first")
        i = min(int(t / self.h + 1e-6), self.steps - 1)
        if torch.is_grad_enabled():
            return self._drive_at(i)
        key = (i, self._inputs, *_versions(self.W, self.b, self.Z))
        if self._drives is None or self._drives[0] != key:
            self._drives = key, self._drive_at(i)
        return self._drives[1]

    def _drive_at(self, i: int) -> Tensor:
        x = self._u[:, i:i + self.window]  # (B, w)
        W = self.W[:, i] if self.W.dim() == 5 else self.W  # (2, w, p, p)
        return torch.einsum("bw,gwpq->gbpq", x, W) + (self.b + self.Z[:, i])[:, None]

    def _update(self, c: Tensor, drive: Tensor) -> Tensor:
        """Φ(c) = λ c + z ⊙ (n − c) (B, p, p) for the core c (B, p, p) and :meth:`_drive`'s drive."""
        if self.recurrence == "kron":
            cB = torch.einsum("bjk,glk->gbjl", c, self.B)  # c B_gᵀ for both gates, then A_g (·)
            pre = torch.einsum("gij,gbjl->gbil", self.A, cB) + drive
        else:  # U_g vec(c), both gates in one product
            pre = torch.einsum("gij,bj->gbi", self.U, c.flatten(1)).view(drive.shape) + drive
        z, n = torch.sigmoid(pre[0]), torch.tanh(pre[1])
        return self.decay * c + z * (n - c)

    def forward(self, t: float, F: Tensor) -> Tensor:
        P, T = self.frames()
        return -self.decay * F + P @ self._update(P.mT @ F @ T, self._drive(t)) @ T.mT

    def bind_right(self, t: float, V: Tensor) -> Callable[[Tensor], Tensor]:
        P, T = self.frames()
        TV, G, drive = (V.mT @ T).mT, V.mT @ V, self._drive(t)  # (B, p, r), (B, r, r), (2, B, p, p)

        def f(K: Tensor) -> Tensor:  # −λ K VᵀV + P Φ(c) TᵀV with c = (Pᵀ K)(Tᵀ V)ᵀ
            return -self.decay * (K @ G) + P @ (self._update((K.mT @ P).mT @ TV.mT, drive) @ TV)
        return f

    def bind_left(self, t: float, X: Tensor) -> Callable[[Tensor], Tensor]:
        P, T = self.frames()
        PX, G, drive = (X.mT @ P).mT, X.mT @ X, self._drive(t)

        def f(L: Tensor) -> Tensor:  # −λ L XᵀX + T Φ(c)ᵀ PᵀX with c = (Pᵀ X)(Tᵀ L)ᵀ
            return -self.decay * (L @ G) + T @ (self._update(PX @ (L.mT @ T), drive).mT @ PX)
        return f

    def bind_project(self, t: float, X: Tensor, V: Tensor) -> Callable[[Tensor], Tensor]:
        P, T = self.frames()
        PX, TV, drive = (X.mT @ P).mT, (V.mT @ T).mT, self._drive(t)
        GX, GV = X.mT @ X, V.mT @ V

        def f(S: Tensor) -> Tensor:  # −λ XᵀX S VᵀV + (PᵀX)ᵀ Φ(c) TᵀV with c = (Pᵀ X) S (Tᵀ V)ᵀ
            return -self.decay * (GX @ S @ GV) + PX.mT @ self._update(PX @ S @ TV.mT, drive) @ TV
        return f


class SequenceClassifier(nn.Module):
    """Classify sequences u (B, steps) with one :class:`LowRankODEBlock` on a
    :class:`GatedMemoryField` (one KSL step per element) and an MLP on the final core.

    **Arguments:**
    - `steps`: the sequence length; `classes`: output width.
    - `controller`: the block's checkpoint/rank controller; `reversible`: reversal backprop
      (``False``: plain autograd through the stored graph, the baseline).
    - `m` (memory m×m), `rank`, `p`, `h`, `window`, `position_weights`, `decay`, `recurrence`: of the field
      and block; `hidden`: the head's width; `seed`: the field's initial parameters and the
      enrichment seeds (the head's ``nn.Linear`` layers draw from torch's global RNG).
    - `causal`: each step's S-substep at its start (``s_time="start"``: the memory after step
      i has read elements 0..i only); ``False``: at its end (``"end"``, one element ahead).

    ``forward(u)`` -> logits (B, classes). The memory starts from a fixed small random
    F₀ (:meth:`initial_state`), so that every sequence starts with a rank-`rank` frame.
    """

    def __init__(self, steps: int, classes: int, *, controller: AbstractController, m: int = 32,
                 rank: int = 8, p: int = 16, h: float = 0.25, window: int = 3,
                 position_weights: bool = False, decay: float = 1.0, recurrence: str = "kron",
                 hidden: int = 128, reversible: bool = True, seed: int = 0, causal: bool = True) -> None:
        super().__init__()
        for name, v in (("steps", steps), ("classes", classes), ("m", m), ("p", p), ("hidden", hidden)):
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"`{name}` must be an int >= 1; got {v!r}")
        if not isinstance(controller, AbstractController):
            raise TypeError(f"`controller` must be a rankwise.ode controller (e.g. FixedController()); "
                            f"got {controller!r}")
        if not 1 <= rank <= m:
            raise ValueError(f"`rank` must be in [1, m={m}]; got {rank}")
        g = torch.Generator().manual_seed(seed)
        self.m = m
        self.field = GatedMemoryField(m, m, p, steps=steps, h=h, window=window,
                                      position_weights=position_weights, decay=decay,
                                      recurrence=recurrence, generator=g)
        self.block = LowRankODEBlock(self.field, rank=rank, steps=steps, h=h, controller=controller,
                                     reversible=reversible, seed=seed, s_time="start" if causal else "end")
        self.head = nn.Sequential(nn.Linear(p * p, hidden), nn.ReLU(), nn.Linear(hidden, classes))

    def initial_state(self, batch: int) -> Tensor:
        """F₀ (batch, m, m): the same small random matrix for every sequence."""
        g = torch.Generator().manual_seed(1)
        F0 = 0.01 * torch.randn(1, self.m, self.m, generator=g, dtype=self.field.P.dtype)
        return F0.to(self.field.P.device).expand(batch, -1, -1)

    def integrate(self, F0: Tensor) -> Tensor:
        """Logits from the initial memory F0 (B, m, m) for the input already set on the field."""
        state = self.block(F0)
        return self.head(self.field.core(state).flatten(1))

    def set_input(self, u: Tensor) -> None:
        """The sequences u (B, steps) the next integration reads (see :meth:`integrate`)."""
        self.field.set_input(u)

    def forward(self, u: Tensor) -> Tensor:
        if u.ndim >= 1 and u.shape[0] == 0:
            raise ValueError(f"`u` is an empty batch (shape {tuple(u.shape)}): give at least one sequence")
        self.set_input(u)
        return self.integrate(self.initial_state(u.shape[0]))
