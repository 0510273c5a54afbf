"""Rank enrichment and the checkpoint/rank controllers."""

import pytest
import torch

from rankwise.ode import DefectController, FixedController, LowRankState, enrich

F64 = torch.float64


def _state(B=2, m=9, n=7, r=3, seed=0):
    g = torch.Generator().manual_seed(seed)
    return LowRankState.from_dense(torch.randn(B, m, n, generator=g, dtype=F64), r)


def test_enrich_orthonormal_changes_f_only_by_alpha_and_follows_the_residual():
    st = _state()
    g = torch.Generator().manual_seed(1)
    A, C = torch.randn(9, 9, dtype=F64), torch.randn(9, 7, dtype=F64)
    field = lambda t, F: A @ F + C  # noqa: E731  (residual: (I − XXᵀ) C (I − VVᵀ))
    new = enrich(st, field, 0.0, 2, alpha=1e-3, generator=g)
    assert new.rank == 5
    for Q in (new.X, new.V):
        torch.testing.assert_close(Q.mT @ Q, torch.eye(5, dtype=F64).expand(2, 5, 5))
    Xn, Vn = new.X[..., 3:], new.V[..., 3:]
    torch.testing.assert_close(new.dense() - st.dense(), 1e-3 * Xn @ Vn.mT)
    G = field(0.0, st.dense())
    R = G - st.X @ (st.X.mT @ G)
    R = R - (R @ st.V) @ st.V.mT
    # the new directions capture the residual's two leading singular directions
    captured = torch.linalg.matrix_norm(Xn.mT @ R @ Vn)
    best = torch.linalg.vector_norm(torch.linalg.svdvals(R)[:, :2], dim=-1)
    assert bool((captured >= 0.999 * best).all())


def test_enrich_with_zero_residual_uses_orthogonal_random_directions():
    st = _state()
    new = enrich(st, lambda t, F: torch.zeros_like(F), 0.0, 2, alpha=0.5,
                 generator=torch.Generator().manual_seed(0))
    torch.testing.assert_close(new.X.mT @ new.X, torch.eye(5, dtype=F64).expand(2, 5, 5))
    torch.testing.assert_close(new.V.mT @ new.V, torch.eye(5, dtype=F64).expand(2, 5, 5))
    with pytest.raises(ValueError, match="alpha"):
        enrich(st, lambda t, F: F, 0.0, 2, alpha=0.0)


def test_defect_controller_rules():
    c = DefectController(tau_warn=1e-6, tau_safe=1e-10, tau_rank=1e-5, tau_svd=1e-3, tau_grad=1e-4,
                         c_init=8, c_max=10, delta_r=2, max_rank=6)
    assert c.initial_spacing() == 8
    assert c.next_spacing(8, 1e-5) == 4 and c.next_spacing(1, 1e-5) == 1  # halve, floor 1
    assert c.next_spacing(8, 1e-12) == 9 and c.next_spacing(10, 1e-12) == 10  # grow, cap
    assert c.next_spacing(8, 1e-8) == 8  # in between: unchanged
    assert c.rank_increase(3, 1e-4, 0.5) == 2  # δ > τ_rank
    assert c.rank_increase(3, 1e-12, 1e-4) == 2  # ρ < τ_svd
    assert c.rank_increase(5, 1e-4, 0.5) == 1 and c.rank_increase(6, 1e-4, 0.5) == 0  # max_rank
    assert c.rank_increase(3, 1e-12, 0.5) == 0
    assert c.reload(1e-3) and not c.reload(1e-5)
    f = FixedController(4, 3)
    assert f.next_spacing(4, 1.0) == 4 and f.rank_increase(3, 1.0, 0.0) == 0 and not f.reload(1.0)
    d = DefectController.for_dtype(torch.float32)
    assert d.tau_safe == pytest.approx(100 * torch.finfo(torch.float32).eps)
    with pytest.raises(ValueError, match="tau_safe"):
        DefectController(tau_warn=1e-9, tau_safe=1e-6, tau_rank=1, tau_svd=0.1, tau_grad=1)


def test_carry_over_spacing_across_forward_passes():
    """carry=True: a forward pass starts where the last one left C (the seed restarts at c_init)."""
    from rankwise.ode import LowRankODEBlock

    c = DefectController.for_dtype(F64, c_init=2, c_max=6)
    assert c.initial_spacing(5) == 2 and c.initial_spacing() == 2
    carry = DefectController.for_dtype(F64, c_init=2, c_max=6, carry=True)
    assert carry.initial_spacing(5) == 5 and carry.initial_spacing() == 2
    assert FixedController(3, 2).initial_spacing(5) == 3

    class Decay(torch.nn.Module):
        def forward(self, t, F):
            return -0.1 * F

    F0 = torch.randn(1, 6, 5, generator=torch.Generator().manual_seed(0), dtype=F64)
    block = LowRankODEBlock(Decay(), rank=3, steps=12, h=0.1, controller=carry)
    block(F0)
    first = block.last_tape.lengths
    block(F0)
    second = block.last_tape.lengths
    assert first == [2, 3, 4, 3] and second == [6, 6]  # δ at roundoff: C grows by one per segment
    block.controller = c
    block(F0)
    assert block.last_tape.lengths[0] == 2


def test_replay_aware_spacing_halves_where_replays_happen_and_relaxes_elsewhere():
    from rankwise.ode import LowRankODEBlock

    class Tanh(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.A = torch.nn.Parameter(0.3 * torch.eye(6, dtype=F64))

        def forward(self, t, F):
            return torch.tanh(self.A @ F) - 0.1 * F

    # τ_grad ~ 0: every reversed step "drifts", so every segment longer than 1 is replayed
    ctl = DefectController.for_dtype(F64, c_init=4, c_max=4, tau_grad=1e-300, replay_aware=True)
    assert ctl.learns_from_replays() and not FixedController(4, 2).learns_from_replays()
    F0 = torch.randn(1, 6, 5, generator=torch.Generator().manual_seed(0), dtype=F64)
    block = LowRankODEBlock(Tanh(), rank=3, steps=8, h=0.1, controller=ctl)
    lengths = []
    for _ in range(4):
        x = F0.clone().requires_grad_(True)
        (block(x).dense() ** 2).sum().backward()
        lengths.append(block.last_tape.lengths)
    # replayed at 4 → cap 2 → replayed → cap 1 (no reversal, no replay) → relaxed to 2
    assert lengths == [[4, 4], [2, 2, 2, 2], [1] * 8, [2, 2, 2, 2]]
