"""The factored field path: KSL substeps from the factors, equal to the dense path."""

import pytest
import torch

from helpers import DenseField
from rankwise.ode import FixedController, LowRankODEBlock, LowRankState, MemoryField, ksl_reverse, ksl_step

F64 = torch.float64


def _field(m=11, n=9, p=4, seed=0):
    return MemoryField(m, n, p, generator=torch.Generator().manual_seed(seed), dtype=F64)


def test_projections_equal_the_dense_field_for_any_factors():
    f = _field()
    g = torch.Generator().manual_seed(1)
    X, K = torch.randn(3, 11, 5, generator=g, dtype=F64), torch.randn(3, 11, 5, generator=g, dtype=F64)
    V, L = torch.randn(3, 9, 5, generator=g, dtype=F64), torch.randn(3, 9, 5, generator=g, dtype=F64)
    S = torch.randn(3, 5, 5, generator=g, dtype=F64)  # not orthonormal: the general formulas
    torch.testing.assert_close(f.apply_right(0.0, K, V), f(0.0, K @ V.mT) @ V, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(f.apply_left(0.0, X, L), f(0.0, X @ L.mT).mT @ X, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(f.project(0.0, X, S, V), X.mT @ f(0.0, X @ S @ V.mT) @ V,
                               rtol=1e-12, atol=1e-12)


def test_steps_and_reverses_equal_the_dense_path_to_roundoff():
    f = _field(seed=2)
    F0 = torch.randn(2, 11, 9, generator=torch.Generator().manual_seed(3), dtype=F64)
    st = LowRankState.from_dense(F0, 4)
    a, b = ksl_step(st, f, 0.0, 0.1), ksl_step(st, DenseField(f), 0.0, 0.1)
    for x, y in ((a.X, b.X), (a.S, b.S), (a.V, b.V)):
        torch.testing.assert_close(x, y, rtol=1e-12, atol=1e-13)
    back = ksl_reverse(a, f, 0.0, 0.1)
    torch.testing.assert_close(back.dense(), st.dense(), rtol=1e-11, atol=1e-12)


@pytest.mark.parametrize("c", [1, 4])
def test_block_gradients_through_the_factored_path_equal_the_dense_path_and_autograd(c):
    F0 = torch.randn(2, 11, 9, generator=torch.Generator().manual_seed(4), dtype=F64)
    f = _field(seed=5)

    def grads(field, reversible):
        block = LowRankODEBlock(field, rank=4, steps=8, h=0.1, controller=FixedController(c, 4),
                                reversible=reversible)
        x = F0.clone().requires_grad_(True)
        (block(x).dense() ** 2).sum().backward()
        out = [x.grad] + [p.grad.clone() for p in f.parameters()]
        f.zero_grad()
        return out

    fac, dense, auto = grads(f, True), grads(DenseField(f), True), grads(f, False)
    for a, b, c_ in zip(fac, dense, auto, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-11)
        torch.testing.assert_close(a, c_, rtol=1e-8, atol=1e-10)
