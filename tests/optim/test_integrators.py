"""The BUG step's pure functions against independent float64 references."""


import numpy as np
import pytest
import torch

from helpers import F64
from rankwise.linalg import tail_rank, truncated_svd
from rankwise.optim import _integrators as bug
from rankwise.optim._step import orth_complement_fixed
from reference_bug import new_directions


def _orth(m, r):
    return torch.linalg.qr(torch.randn(m, r, dtype=F64))[0]


def _kept(Q0, X):
    """The valid columns of :func:`orth_complement_fixed` for one pair (m, k), (m, c)."""
    E, valid, failed = orth_complement_fixed(Q0[None], X[None])
    assert not failed.any()
    return E[0][:, valid[0]]


def test_orth_complement_spans_inputs_and_drops_dependent_columns():
    Q0 = _orth(12, 3)
    a = torch.randn(12, 2, dtype=F64)
    dep = Q0 @ torch.randn(3, 2, dtype=F64) + a @ torch.randn(2, 2, dtype=F64)  # in span[Q0, a]
    E = _kept(Q0, torch.cat([a, dep, torch.zeros(12, 1, dtype=F64)], 1))
    Q = torch.cat([Q0, E], 1)
    assert Q.shape == (12, 5)
    torch.testing.assert_close(Q.T @ Q, torch.eye(5, dtype=F64))
    for M in (Q0, a, dep):
        torch.testing.assert_close(Q @ (Q.T @ M), M)  # span contains every input
    assert _kept(Q0, Q0 @ torch.randn(3, 4, dtype=F64)).shape == (12, 0)


def test_tail_rank_matches_brute_force():
    g = torch.Generator().manual_seed(3)
    for _ in range(50):
        s = torch.rand(8, generator=g, dtype=F64).sort(descending=True).values
        tol = float(torch.rand(1, generator=g)) * float(s.norm())
        brute = next(r for r in range(9) if float(s[r:].norm()) <= tol)
        assert tail_rank(s, tol) == max(brute, 1)
        assert tail_rank(s, tol, min_rank=3, max_rank=5) == min(max(brute, 3), 5)


def test_truncated_svd_matches_numpy():
    W = torch.randn(7, 5, dtype=F64)
    U, s, V = truncated_svd(W, rank=3)
    ref = np.linalg.svd(W.numpy(), compute_uv=False)
    np.testing.assert_allclose(s.numpy(), ref[:3], rtol=1e-12)
    assert float(torch.linalg.matrix_norm(W - U @ torch.diag(s) @ V.T)) == pytest.approx(
        float(np.sqrt((ref[3:] ** 2).sum())), abs=1e-12)


def _setup(m=15, n=11, r=3, b=2):
    U0, V0 = _orth(m, r), _orth(n, r)
    S0 = torch.randn(r, r, dtype=F64)
    dK, dL = torch.randn(m, r, dtype=F64), torch.randn(n, r, dtype=F64)
    # buffers: orthonormal, orthogonal to U0 / V0 (and here also to the updates)
    Ub = new_directions(torch.cat([U0, new_directions(U0, dK)[0]], 1), torch.randn(m, b, dtype=F64))[0]
    Vb = new_directions(torch.cat([V0, new_directions(V0, dL)[0]], 1), torch.randn(n, b, dtype=F64))[0]
    return U0, S0, V0, dK, dL, Ub, Vb


def test_reorthonormalize_keeps_weight_and_gradient():
    U0, S0, V0, _, _, Ub, Vb = _setup()
    U = U0 @ (torch.eye(3, dtype=F64) + 1e-3 * torch.randn(3, 3, dtype=F64))  # drifted bases
    V = V0 @ (torch.eye(3, dtype=F64) + 1e-3 * torch.randn(3, 3, dtype=F64))
    G = torch.randn(15, 11, dtype=F64)
    f = bug.Factors(U, S0, V, G @ V, U.T @ G @ V, G.T @ U, Ub, Vb)
    g = bug.reorthonormalize(f)
    torch.testing.assert_close(g.U @ g.S @ g.V.T, U @ S0 @ V.T)
    for Q in (torch.cat([g.U, g.U_buf], 1), torch.cat([g.V, g.V_buf], 1)):
        torch.testing.assert_close(Q.T @ Q, torch.eye(Q.shape[1], dtype=F64))
    torch.testing.assert_close(g.G_K, G @ g.V)
    torch.testing.assert_close(g.G_L, G.T @ g.U)
    torch.testing.assert_close(g.G_S, g.U.T @ G @ g.V)


def test_orth_complement_float32_orthogonality():
    Q0 = torch.linalg.qr(torch.randn(2048, 100))[0]
    X = torch.randn(2048, 100) + Q0 @ torch.randn(100, 100) * 10  # mostly inside span(Q0)
    X[:, 5] = X[:, 4] + 0.1 * X[:, 6]  # a dependent column: dropped
    X[:, 7] = X[:, 8] + 1e-2 * torch.randn(2048)  # nearly dependent (σ ~ 1e-3 > √eps): kept
    E = _kept(Q0, X)
    assert E.shape[1] == 99
    eps = torch.finfo(torch.float32).eps
    assert float((E.T @ E - torch.eye(99)).abs().max()) < 50 * eps
    assert float((Q0.T @ E).abs().max()) < 50 * eps


def test_orth_complement_of_a_batch_equals_each_pair():
    """A batch with a pair whose X has dependent columns (it keeps fewer directions), one at
    an extreme scale (rescaled inside) and one zero X: each result spans what the independent
    reference's does and what the pair alone gives, with orthonormal columns orthogonal to Q0;
    a non-finite X drops every direction of its own pair only."""
    g = torch.Generator().manual_seed(5)
    m, r, c = 30, 4, 5
    Q0 = torch.stack([torch.linalg.qr(torch.randn(m, r, generator=g, dtype=F64))[0] for _ in range(4)])
    X = torch.randn(4, m, c, generator=g, dtype=F64)
    X[1, :, 3:] = X[1, :, :2] + Q0[1] @ torch.randn(r, 2, generator=g, dtype=F64)  # 2 dependent
    X[2] *= 1e17
    X[3] = 0
    E, valid, failed = orth_complement_fixed(Q0, X)
    assert valid.sum(-1).tolist() == [5, 3, 5, 0] and not failed.any()
    for i in range(4):
        got = E[i][:, valid[i]]
        ref = new_directions(Q0[i], X[i])[0] if i != 3 else got
        alone = _kept(Q0[i], X[i])
        assert got.shape == ref.shape == alone.shape
        torch.testing.assert_close(got @ got.T, ref @ ref.T)  # the same subspace
        torch.testing.assert_close(got @ got.T, alone @ alone.T)
        torch.testing.assert_close(E[i].T @ E[i], torch.eye(5, dtype=F64))
        assert float((Q0[i].T @ E[i]).abs().max()) < 1e-12
    assert torch.equal(E, orth_complement_fixed(Q0, X.clone())[0])  # the same batch: the same bits
    X[2, 0, 0] = float("nan")
    E2, valid2, _ = orth_complement_fixed(Q0, X)
    assert valid2.sum(-1).tolist() == [5, 3, 0, 0] and torch.isfinite(E2).all()
    torch.testing.assert_close(E2[:2], E[:2], rtol=0, atol=1e-12)

