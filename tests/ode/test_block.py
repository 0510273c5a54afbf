"""LowRankODEBlock: reversal backprop against dense autograd through the stored graph."""

import pytest
import torch
from torch import nn

from rankwise.ode import DefectController, FixedController, LowRankODEBlock, LowRankState, audit_gradients

F64 = torch.float64


class Field(nn.Module):
    def __init__(self, m: int, n: int, seed: int = 0) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(seed)
        self.A = nn.Parameter(0.3 * torch.randn(m, m, generator=g, dtype=F64))
        self.B = nn.Parameter(0.3 * torch.randn(n, n, generator=g, dtype=F64))
        self.C = nn.Parameter(0.3 * torch.randn(m, n, generator=g, dtype=F64))

    def forward(self, t, F):
        return torch.tanh(self.A @ F @ self.B.T) - 0.1 * F + self.C


def _loss(st: LowRankState):
    return (st.dense() ** 2).sum()


def _grads(block, F0, reversible):
    block.reversible = reversible
    x = F0.clone().requires_grad_(True)
    _loss(block(x)).backward()
    out = [x.grad] + [p.grad.clone() for p in block.field.parameters()]
    block.field.zero_grad()
    return out


@pytest.mark.parametrize("rank", [4, 8])
def test_reversal_gradients_equal_dense_autograd(rank):
    F0 = torch.randn(3, 10, 8, generator=torch.Generator().manual_seed(1), dtype=F64)
    block = LowRankODEBlock(Field(10, 8), rank=rank, steps=10, h=0.05, controller=FixedController(1, rank))
    rev = _grads(block, F0, True)
    ref = _grads(block, F0, False)
    for a, b in zip(rev, ref, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-11)  # C = 1: roundoff
    block.controller = FixedController(4, rank)
    assert audit_gradients(block, F0, _loss) > 0.9999
    assert block.last_stats["checkpoints"] == 3 and block.last_stats["max_delta"] < 1e-13


def test_controller_schedule_enrichment_and_reload_keep_gradients_exact():
    F0 = torch.randn(2, 10, 8, generator=torch.Generator().manual_seed(2), dtype=F64)
    ctl = DefectController.for_dtype(F64, c_init=4, max_rank=6, tau_svd=0.99, tau_grad=1e-300)
    block = LowRankODEBlock(Field(10, 8, seed=3), rank=3, steps=12, h=0.05, controller=ctl)
    assert audit_gradients(block, F0, _loss) > 1 - 1e-12
    tape = block.last_tape
    assert [e is not None for e in tape.enrichments][:2] == [True, True]  # ρ < τ_svd: enrich
    assert tape.lengths[0] == 4 and tape.lengths[1] == 5  # δ < τ_safe: C grows
    block.reversible = True
    _loss(block(F0.clone().requires_grad_(True))).backward()
    assert block.last_stats["rank"] == 6 and block.last_stats["reloads"] > 0  # τ_grad ~ 0: reload


def test_failed_reverse_falls_back_to_replay_for_every_controller():
    """A stiff field (h·Lip > 1): the fixed-point reverse cannot converge, the local defect is
    large, and the backward replays from checkpoints instead of returning wrong gradients."""
    F0 = torch.randn(2, 10, 8, generator=torch.Generator().manual_seed(4), dtype=F64)
    field = Field(10, 8, seed=5)
    with torch.no_grad():
        field.A.mul_(15.0)
        field.B.mul_(15.0)
    block = LowRankODEBlock(field, rank=4, steps=8, h=0.3, controller=FixedController(4, 4))
    rev = _grads(block, F0, True)
    assert block.last_stats["reloads"] > 0
    ref = _grads(block, F0, False)
    for a, b in zip(rev, ref, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-8, atol=1e-10)


def test_whole_run_reversed_without_replay_matches_autograd():
    """One segment of 20 steps, well-conditioned core: every state is rebuilt by the reverse
    (in its own QR frames, no rotations stored) and the cotangent is carried across frames; no
    replay may happen, and the gradients still equal dense autograd."""
    F0 = torch.randn(3, 10, 8, generator=torch.Generator().manual_seed(6), dtype=F64)
    block = LowRankODEBlock(Field(10, 8, seed=7), rank=5, steps=20, h=0.05,
                            controller=FixedController(20, 5))
    rev = _grads(block, F0, True)
    assert block.last_stats["checkpoints"] == 1 and block.last_stats["reloads"] == 0
    ref = _grads(block, F0, False)
    for a, b in zip(rev, ref, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-8, atol=1e-10)


def test_tape_keeps_only_checkpoints():
    from rankwise.ode._tape import tape_bytes

    F0 = torch.randn(2, 10, 8, generator=torch.Generator().manual_seed(8), dtype=F64)
    block = LowRankODEBlock(Field(10, 8), rank=4, steps=16, h=0.05, controller=FixedController(4, 4))
    block(F0)
    per_state = 2 * (10 * 4 + 4 * 4 + 8 * 4) * 8  # batch 2, float64
    assert tape_bytes(block.last_tape) == 4 * per_state


def test_loss_that_sees_the_factors_frame_falls_back_to_replay():
    """A loss on X or S themselves is not frame-invariant: carrying the cotangent across QR
    frames would be wrong (18 % off in a review), so every segment must be replayed."""
    F0 = torch.randn(2, 10, 8, generator=torch.Generator().manual_seed(9), dtype=F64)
    block = LowRankODEBlock(Field(10, 8, seed=1), rank=4, steps=20, h=0.05, controller=FixedController(20, 4))

    def loss(st):
        return st.X[..., 0].sum() + (torch.diagonal(st.S, dim1=-2, dim2=-1) ** 2).sum()

    grads = []
    for rev in (True, False):
        block.reversible = rev
        x = F0.clone().requires_grad_(True)
        loss(block(x)).backward()
        grads.append([x.grad] + [p.grad.clone() for p in block.field.parameters()])
        block.field.zero_grad()
        if rev:
            assert block.last_stats["reloads"] == 1  # the one segment, replayed
    for a, b in zip(*grads, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-8, atol=1e-10)


def test_nan_defect_counts_as_failure():
    """h·‖A‖ ≈ 60: the fixed-point reverse returns NaN; NaN must trigger the replay (a NaN
    compared with '>' would silently pass) and the controller must halve C."""
    class Linear(nn.Module):
        def __init__(self):
            super().__init__()
            self.A = nn.Parameter(60 * torch.eye(10, dtype=F64))

        def forward(self, t, F):
            return self.A @ F

    F0 = torch.randn(1, 10, 8, generator=torch.Generator().manual_seed(0), dtype=F64)
    block = LowRankODEBlock(Linear(), rank=3, steps=4, h=1.0, controller=FixedController(4, 3))
    x = F0.clone().requires_grad_(True)
    (block(x).dense() ** 2).sum().backward()
    assert block.last_stats["reloads"] == 1 and torch.isfinite(x.grad).all()
    nan = float("nan")
    ctl = DefectController.for_dtype(F64)
    assert ctl.next_spacing(8, nan) == 4 and ctl.reload(nan) and ctl.rank_increase(3, nan, 0.5) > 0


def test_solve_returns_a_solution_whose_stats_the_backward_completes():
    from rankwise.ode import OdeSolution

    F0 = torch.randn(2, 10, 8, generator=torch.Generator().manual_seed(6), dtype=F64, requires_grad=True)
    block = LowRankODEBlock(Field(10, 8, seed=7), rank=3, steps=8, h=0.05, controller=FixedController(3, 3))
    sol = block.solve(F0)
    assert isinstance(sol, OdeSolution) and sol.tape.lengths == [3, 3, 2] and "reloads" not in sol.stats
    (sol.state.dense() ** 2).sum().backward()
    assert sol.stats["reloads"] == 0 and sol.stats["checkpoints"] == 3  # completed in place
    assert block.last_solution is sol and block.last_stats is sol.stats and block.last_tape is sol.tape
    torch.testing.assert_close(block(F0).dense(), sol.state.dense())
    block.reversible = False  # a plain-autograd pass has no tape and leaves last_solution alone
    plain = block.solve(F0)
    assert plain.tape is None and plain.stats == {} and block.last_solution is not plain
