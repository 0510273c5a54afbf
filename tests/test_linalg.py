"""rankwise.linalg's batched helpers against their per-matrix selves (float64)."""

import pytest
import torch

from rankwise.linalg import orth_against, orthonormalize, truncated_svd
from reference_bug import new_directions

F64 = torch.float64


def test_orthonormalize_is_batched_and_fixes_the_signs():
    A = torch.randn(3, 9, 4, generator=torch.Generator().manual_seed(0), dtype=F64)
    Q, R = orthonormalize(A)
    for b in range(3):
        q, r = orthonormalize(A[b])
        torch.testing.assert_close(Q[b], q, rtol=0, atol=0)
        torch.testing.assert_close(R[b], r, rtol=0, atol=0)
    assert bool((torch.diagonal(R, dim1=-2, dim2=-1) >= 0).all())
    torch.testing.assert_close(Q @ R, A)
    torch.testing.assert_close(Q.mT @ Q, torch.eye(4, dtype=F64).expand(3, 4, 4))


def test_truncated_svd_of_a_batch_with_a_rank():
    W = torch.randn(2, 7, 5, generator=torch.Generator().manual_seed(1), dtype=F64)
    U, s, V = truncated_svd(W, rank=3)
    assert U.shape == (2, 7, 3) and s.shape == (2, 3) and V.shape == (2, 5, 3)
    for b in range(2):
        u, sb, v = truncated_svd(W[b], rank=3)
        torch.testing.assert_close(U[b] * s[b] @ V[b].mT, u * sb @ v.mT)
    with pytest.raises(ValueError, match="single matrix"):
        truncated_svd(W, tau=0.1)


def test_orth_against_spans_the_projected_columns():
    g = torch.Generator().manual_seed(2)
    Q0 = orthonormalize(torch.randn(3, 10, 3, generator=g, dtype=F64))[0]
    Y = torch.randn(3, 10, 2, generator=g, dtype=F64)
    Q = orth_against(Q0, Y)
    torch.testing.assert_close(Q.mT @ Q, torch.eye(2, dtype=F64).expand(3, 2, 2))
    torch.testing.assert_close(Q0.mT @ Q, torch.zeros(3, 3, 2, dtype=F64), rtol=0, atol=1e-14)
    for b in range(3):  # the same subspace as the independent float64 reference's complement
        ref = new_directions(Q0[b], Y[b])[0]
        torch.testing.assert_close(Q[b] @ Q[b].mT, ref @ ref.mT)


