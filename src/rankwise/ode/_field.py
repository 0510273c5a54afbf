"""Vector fields that act on the factors: the KSL substeps without the dense state.

A KSL step needs the field only through three projections (K = X S, L = V Sᵀ):

- K-step: f(t, K Vᵀ) V  (B, m, r)
- S-step: Xᵀ f(t, X S Vᵀ) V  (B, r, r)
- L-step: f(t, X Lᵀ)ᵀ X  (B, n, r)

A plain field forms F (B, m, n) for each, O(m·n) per sample however small r is. A
:class:`FactoredField` computes them from the factors directly; :func:`rankwise.ode.ksl_step`,
:func:`~rankwise.ode.ksl_reverse` and :class:`~rankwise.ode.LowRankODEBlock` use those methods
when the field has them, and its dense ``forward`` everywhere else (rank enrichment, tests).

Within one substep t and the fixed factor (V, X, or X and V) do not change: the reverse's
implicit solve evaluates the same projection about eight times at new K, S or L. The
``bind_*`` methods return the projection as a function of that one argument, so that a field
can compute once what does not depend on it (its frames against V, the input's drive);
:mod:`._ksl` calls them once per substep.
"""

from __future__ import annotations

import abc
from collections.abc import Callable

import torch
from torch import Tensor, nn


class FactoredField(nn.Module, abc.ABC):
    """A field f(t, F) with its three KSL projections computed from the factors.

    Subclasses implement :meth:`forward` (dense, the reference) and :meth:`project`, the product
    Yᵀ f(t, X C Wᵀ) Z for factors X (B, m, a), C (B, a, b), W (B, n, b) and test matrices
    Y (B, m, p), Z (B, n, q) -> (B, p, q), plus :meth:`apply_right` / :meth:`apply_left` for the
    K- and L-steps, whose outputs are tall (m×r, n×r)."""

    @abc.abstractmethod
    def forward(self, t: float, F: Tensor) -> Tensor:
        """dF/dt for F (B, m, n) -> (B, m, n)."""

    @abc.abstractmethod
    def apply_right(self, t: float, K: Tensor, V: Tensor) -> Tensor:
        """f(t, K Vᵀ) V for K (B, m, r), V (B, n, r) -> (B, m, r)."""

    @abc.abstractmethod
    def apply_left(self, t: float, X: Tensor, L: Tensor) -> Tensor:
        """f(t, X Lᵀ)ᵀ X for X (B, m, r), L (B, n, r) -> (B, n, r)."""

    def project(self, t: float, X: Tensor, S: Tensor, V: Tensor) -> Tensor:
        """Xᵀ f(t, X S Vᵀ) V (B, r, r); default: from :meth:`apply_right` with K = X S."""
        return X.mT @ self.apply_right(t, X @ S, V)

    def bind_right(self, t: float, V: Tensor) -> Callable[[Tensor], Tensor]:
        """K ↦ f(t, K Vᵀ) V for this t and V; default: :meth:`apply_right` per call."""
        return lambda K: self.apply_right(t, K, V)

    def bind_left(self, t: float, X: Tensor) -> Callable[[Tensor], Tensor]:
        """L ↦ f(t, X Lᵀ)ᵀ X for this t and X; default: :meth:`apply_left` per call."""
        return lambda L: self.apply_left(t, X, L)

    def bind_project(self, t: float, X: Tensor, V: Tensor) -> Callable[[Tensor], Tensor]:
        """S ↦ Xᵀ f(t, X S Vᵀ) V for this t, X and V; default: :meth:`project` per call."""
        return lambda S: self.project(t, X, S, V)


class BoundField(FactoredField):
    """A :class:`FactoredField` written through its ``bind_*`` methods (which a subclass
    implements); ``apply_right``, ``apply_left`` and ``project`` bind and call once."""

    @abc.abstractmethod
    def bind_right(self, t: float, V: Tensor) -> Callable[[Tensor], Tensor]: ...

    @abc.abstractmethod
    def bind_left(self, t: float, X: Tensor) -> Callable[[Tensor], Tensor]: ...

    @abc.abstractmethod
    def bind_project(self, t: float, X: Tensor, V: Tensor) -> Callable[[Tensor], Tensor]: ...

    def apply_right(self, t: float, K: Tensor, V: Tensor) -> Tensor:
        return self.bind_right(t, V)(K)

    def apply_left(self, t: float, X: Tensor, L: Tensor) -> Tensor:
        return self.bind_left(t, X)(L)

    def project(self, t: float, X: Tensor, S: Tensor, V: Tensor) -> Tensor:
        return self.bind_project(t, X, V)(S)


class MemoryField(FactoredField):
    """A linear-plus-low-rank-nonlinear matrix-memory field, every term factorable:

        f(t, F) = −λ F + diag(α) F + F diag(β) + P tanh(Qᵀ F R) Tᵀ + a bᵀ

    with P, Q (m, p), R, T (n, p), α (m,), β (n,), a (m,), b (n,) learned; λ = `decay`. From the
    factors, Qᵀ F R = (Qᵀ K)(Vᵀ R) costs O((m + n)·r·p) per sample instead of O(m·n·p), and
    every other term is a diagonal or rank-p product. `p`: the nonlinear part's rank."""

    def __init__(self, m: int, n: int, p: int = 8, *, decay: float = 0.2, scale: float = 0.3,
                 generator: torch.Generator | None = None, dtype: torch.dtype = torch.float32) -> None:
        super().__init__()
        if min(m, n, p) < 1:
            raise ValueError(f"need m, n, p >= 1; got {m}, {n}, {p}")
        g = generator

        def rand(*shape: int) -> Tensor:
            return torch.randn(*shape, generator=g, dtype=dtype)

        self.decay = decay
        self.alpha = nn.Parameter(0.1 * rand(m))
        self.beta = nn.Parameter(0.1 * rand(n))
        self.P = nn.Parameter(scale * rand(m, p) / p**0.5)
        self.Q = nn.Parameter(rand(m, p) / m**0.5)
        self.R = nn.Parameter(rand(n, p) / n**0.5)
        self.T = nn.Parameter(scale * rand(n, p) / p**0.5)
        self.a = nn.Parameter(0.1 * rand(m) / m**0.5)
        self.b = nn.Parameter(0.1 * rand(n) / n**0.5)

    def forward(self, t: float, F: Tensor) -> Tensor:
        del t
        inner = torch.tanh(self.Q.mT @ F @ self.R)  # (B, p, p)
        return (-self.decay * F + self.alpha[:, None] * F + F * self.beta[None, :]
                + self.P @ inner @ self.T.mT + self.a[:, None] * self.b[None, :])

    def apply_right(self, t: float, K: Tensor, V: Tensor) -> Tensor:
        del t  # f(K Vᵀ) V, term by term; F = K Vᵀ is never formed
        KG = K @ (V.mT @ V)  # (= K for orthonormal V)
        inner = torch.tanh((self.Q.mT @ K) @ (V.mT @ self.R))  # (B, p, p)
        return (-self.decay * KG + self.alpha[:, None] * KG + K @ (V.mT @ (self.beta[:, None] * V))
                + self.P @ (inner @ (self.T.mT @ V)) + self.a[:, None] * (self.b @ V)[..., None, :])

    def apply_left(self, t: float, X: Tensor, L: Tensor) -> Tensor:
        del t  # f(X Lᵀ)ᵀ X; F = X Lᵀ is never formed
        LG = L @ (X.mT @ X)  # (= L for orthonormal X)
        inner = torch.tanh((self.Q.mT @ X) @ (L.mT @ self.R))  # (B, p, p)
        return (-self.decay * LG + L @ (X.mT @ (self.alpha[:, None] * X)) + self.beta[:, None] * LG
                + self.T @ (inner.mT @ (self.P.mT @ X)) + self.b[:, None] * (self.a @ X)[..., None, :])
