"""The reverse's implicit Euler solves: Picard and Anderson against a direct solve."""

import pytest
import torch

from rankwise.ode._implicit import solve_implicit_euler

F64 = torch.float64


def _linear(B=4, n=12, k=3, scale=1.5, seed=0):
    g = torch.Generator().manual_seed(seed)
    A = scale * torch.randn(B, n, n, generator=g, dtype=F64) / n**0.5
    y1 = torch.randn(B, n, k, generator=g, dtype=F64)
    return A, y1


@pytest.mark.parametrize("solver", ["picard", "anderson"])
def test_a_linear_substep_is_inverted_to_roundoff(solver):
    """y0 + h A y0 = y1: the solver's y0 equals (I + hA)⁻¹ y1 from a direct solve."""
    A, y1 = _linear()
    h = 0.2
    y0, evals = solve_implicit_euler(lambda y: A @ y, y1, h, solver=solver)
    exact = torch.linalg.solve(torch.eye(12, dtype=F64) + h * A, y1)
    torch.testing.assert_close(y0, exact, rtol=1e-13, atol=1e-13)
    assert 2 <= evals < 60


def test_anderson_takes_fewer_evaluations_to_the_same_answer():
    g = torch.Generator().manual_seed(3)
    W = torch.randn(6, 10, 10, generator=g, dtype=F64) / 10**0.5
    y1 = torch.randn(6, 10, 4, generator=g, dtype=F64)
    f = lambda y: torch.tanh(W @ y) * 2.0  # noqa: E731  (nonlinear; h·Lip ≈ 0.5)
    h = 0.25
    (yp, ep), (ya, ea) = (solve_implicit_euler(f, y1, h, solver=s) for s in ("picard", "anderson"))
    for y0 in (yp, ya):  # both satisfy the implicit equation to roundoff
        torch.testing.assert_close(y0 + h * f(y0), y1, rtol=0, atol=1e-13)
    torch.testing.assert_close(ya, yp, rtol=0, atol=1e-13)
    assert ea < ep, (ea, ep)


def test_elements_converge_independently_and_a_bad_solver_is_named():
    A, y1 = _linear(B=3)
    A[1] *= 2.5  # one element contracts slowly (h·ρ(A) ≈ 0.75); the others must stay put meanwhile
    h = 0.2
    y0, _ = solve_implicit_euler(lambda y: A @ y, y1, h, solver="anderson")
    exact = torch.linalg.solve(torch.eye(12, dtype=F64) + h * A, y1)
    torch.testing.assert_close(y0, exact, rtol=1e-12, atol=1e-12)
    with pytest.raises(ValueError, match="solver"):
        solve_implicit_euler(lambda y: y, y1, h, solver="newton")
