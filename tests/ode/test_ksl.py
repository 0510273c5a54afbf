"""KSL projector splitting and its exact reverse, against independent references (float64)."""

import numpy as np
import pytest
import scipy.linalg
import torch

from rankwise.ode import LowRankState, ksl_reverse, ksl_step, rank_ratio, reversal_defect

F64 = torch.float64


def _problem(B=3, m=8, n=6, seed=0):
    g = torch.Generator().manual_seed(seed)
    A = 0.3 * torch.randn(m, m, generator=g, dtype=F64)
    Bm = 0.3 * torch.randn(n, n, generator=g, dtype=F64)
    F0 = torch.randn(B, m, n, generator=g, dtype=F64)
    return A, Bm, F0


def _nonlinear(A, Bm):
    return lambda t, F: torch.tanh(A @ F @ Bm.T) - 0.1 * F + 0.05 * (F @ F.mT @ F) * np.cos(t)


def test_full_rank_defect_is_roundoff_and_reverse_inverts_step():
    A, Bm, F0 = _problem()
    field = _nonlinear(A, Bm)
    st = LowRankState.from_dense(F0, 6)
    for h in (0.2, 0.05, 0.01):
        assert float(reversal_defect(st, field, 0.3, h).max()) < 1e-12
        fwd = ksl_step(st, field, 0.3, h)
        torch.testing.assert_close(ksl_reverse(fwd, field, 0.3, h).dense(), F0, rtol=0, atol=1e-12)
        back = ksl_reverse(st, field, 0.3, h)  # and the other way round
        torch.testing.assert_close(ksl_step(back, field, 0.3, h).dense(), F0, rtol=0, atol=1e-12)


def test_defect_is_the_measured_reconstruction_error():
    A, Bm, F0 = _problem(seed=1)
    field = _nonlinear(A, Bm)
    st = LowRankState.from_dense(F0, 3)
    back = ksl_reverse(ksl_step(st, field, 0.0, 0.1), field, 0.0, 0.1)
    F = st.dense()
    expect = torch.linalg.matrix_norm(back.dense() - F) / torch.linalg.matrix_norm(F)
    torch.testing.assert_close(reversal_defect(st, field, 0.0, 0.1), expect, rtol=1e-12, atol=0)


def test_naive_reverse_at_minus_h_is_not_an_inverse():
    """The seed's trap: substeps run at −h leave an O(h²) defect even at full rank."""
    A, Bm, F0 = _problem(seed=2)
    field = _nonlinear(A, Bm)
    st = LowRankState.from_dense(F0, 6)
    d = []
    for h in (0.04, 0.02, 0.01):
        back = ksl_step(ksl_step(st, field, 0.0, h), field, h, -h)
        d.append(float((torch.linalg.matrix_norm(back.dense() - F0) / torch.linalg.matrix_norm(F0)).max()))
    slopes = np.diff(np.log(d)) / np.diff(np.log([0.04, 0.02, 0.01]))
    assert d[-1] > 1e-6 and all(1.7 < s < 2.3 for s in slopes)


def test_ksl_matches_expm_for_a_linear_matrix_ode_at_first_order():
    """F' = A F + F Bᵀ has F(t) = e^{At} F0 e^{Bᵀt}: rank preserved, KSL error O(h)."""
    A, Bm, _ = _problem(seed=3)
    g = torch.Generator().manual_seed(4)
    F0 = (torch.randn(1, 8, 3, generator=g, dtype=F64) @ torch.randn(1, 3, 6, generator=g, dtype=F64))
    T = 0.8
    eA, eB = scipy.linalg.expm(A.numpy() * T), scipy.linalg.expm(Bm.numpy().T * T)
    exact = torch.from_numpy(eA @ F0[0].numpy() @ eB)
    field = lambda t, F: A @ F + F @ Bm.T  # noqa: E731
    errs = []
    for steps in (20, 40, 80):
        st, h = LowRankState.from_dense(F0, 3), T / steps
        for i in range(steps):
            st = ksl_step(st, field, i * h, h)
        errs.append(float(torch.linalg.matrix_norm(st.dense()[0] - exact)))
    slopes = np.diff(np.log(errs)) / np.diff(np.log([20, 40, 80]))
    assert all(-1.2 < s < -0.8 for s in slopes), (errs, slopes)


@pytest.mark.parametrize("smin", [1e-4, 0.0])
def test_singular_core_defect_findings(smin):
    """Documented finding (docs/ode.md): with exact substep inverses, a (numerically) singular
    core does not raise δ in float64 — the discarded directions carry no weight in the product —
    for a linear field and for a nonlinear one; float32 stays within ~20× its roundoff."""
    A, Bm, _ = _problem(B=2)
    for field in (lambda t, F: A @ F + F @ Bm.T, _nonlinear(A, Bm)):
        for dt, bound in ((F64, 1e-14), (torch.float32, 5e-6)):
            g = torch.Generator().manual_seed(5)
            X = torch.linalg.qr(torch.randn(2, 8, 4, generator=g, dtype=dt))[0]
            V = torch.linalg.qr(torch.randn(2, 6, 4, generator=g, dtype=dt))[0]
            S = torch.diag_embed(torch.tensor([1.0, 0.5, smin, smin], dtype=dt)).expand(2, 4, 4)
            f = lambda t, F, fld=field: fld(t, F.double()).to(F.dtype)  # noqa: E731
            for h in (0.1, 0.025):
                assert float(reversal_defect(LowRankState(X, S, V), f, 0.0, h).max()) < bound


def test_rank_ratio_and_state_shapes():
    _, _, F0 = _problem()
    st = LowRankState.from_dense(F0, 4)
    s = np.linalg.svd(st.S.numpy(), compute_uv=False)
    np.testing.assert_allclose(rank_ratio(st).numpy(), s[:, -1] / s[:, 0], rtol=1e-12)
    assert st.rank == 4 and st.dense().shape == (3, 8, 6)
    with pytest.raises(ValueError, match="inconsistent"):
        LowRankState(st.X, st.S[:, :3, :3], st.V)


def test_reverse_with_the_steps_rotations_returns_the_forwards_own_factors():
    """Without rotations the factors come back in rotated bases (same product); with the ones
    ksl_step reports, X0, S0 and V0 themselves come back."""
    A, Bm, F0 = _problem(seed=4)
    field = _nonlinear(A, Bm)
    st = LowRankState.from_dense(F0, 4)
    fwd, rotations = ksl_step(st, field, 0.1, 0.05, return_rotations=True)
    assert torch.equal(fwd.dense(), ksl_step(st, field, 0.1, 0.05).dense())
    plain = ksl_reverse(fwd, field, 0.1, 0.05)
    assert (plain.X - st.X).abs().max() > 1e-3  # a rotated basis
    back = ksl_reverse(fwd, field, 0.1, 0.05, rotations=rotations)
    for a, b in ((back.X, st.X), (back.S, st.S), (back.V, st.V)):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-11)
