"""LowRankState: a batch of matrices F = X S Vᵀ kept in factored form."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from ..linalg import truncated_svd


@dataclass(frozen=True)
class LowRankState:
    """Batched factors: X (B, m, r) with orthonormal columns, S (B, r, r), V (B, n, r)."""

    X: Tensor
    S: Tensor
    V: Tensor

    def __post_init__(self) -> None:
        X, S, V = self.X, self.S, self.V
        if X.dim() != 3 or S.dim() != 3 or V.dim() != 3:
            raise ValueError(f"X, S, V must be (B, m, r), (B, r, r), (B, n, r); got "
                             f"{tuple(X.shape)}, {tuple(S.shape)}, {tuple(V.shape)}")
        B, r = X.shape[0], X.shape[2]
        if S.shape != (B, r, r) or V.shape[0] != B or V.shape[2] != r:
            raise ValueError(f"inconsistent factor shapes: X {tuple(X.shape)}, S {tuple(S.shape)}, "
                             f"V {tuple(V.shape)}")

    @property
    def rank(self) -> int:
        return self.S.shape[-1]

    def dense(self) -> Tensor:
        """F = X S Vᵀ, (B, m, n)."""
        return self.X @ self.S @ self.V.mT

    @staticmethod
    def from_dense(F: Tensor, rank: int) -> LowRankState:
        """Truncated SVD of each matrix in the batch F (B, m, n)."""
        U, s, V = truncated_svd(F, rank=rank)
        return LowRankState(U, torch.diag_embed(s), V)
