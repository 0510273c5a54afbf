"""The memory-budget controller and the binomial (revolve) schedule it follows."""

import itertools
from math import comb

import pytest
import torch
from test_block import F64, Field, _grads

from rankwise.ode import LowRankODEBlock, LowRankState, MemoryBudget
from rankwise.ode._revolve import plan, planned_cost, recompute_cost, split


def _griewank(n: int, slots: int) -> int:
    """Griewank's closed form t(n, S) for S checkpoints (the initial state among them)."""
    r = 0
    while comb(slots + r, slots) < n:
        r += 1
    return r * n - comb(slots + r, slots + 1)


def test_recompute_cost_is_griewanks_binomial_optimum():
    for n in range(1, 60):
        for s in range(0, 8):
            assert recompute_cost(n, s) == _griewank(n, s + 1), (n, s)
    assert split(10, 0) == 0 and split(1, 3) == 0 and 1 <= split(10, 2) < 10
    with pytest.raises(ValueError, match="n >= 0"):
        recompute_cost(-1, 2)


def _brute_force(n: int, s: int) -> int:
    """Every set of at most s checkpoint positions in the forward pass; segment j reversed
    optimally with the s − j slots left."""
    best = None
    for k in range(min(s, n - 1) + 1):
        for pos in itertools.combinations(range(1, n), k):
            edges = [0, *pos, n]
            c = sum(recompute_cost(b - a, s - j) for j, (a, b) in enumerate(itertools.pairwise(edges)))
            best = c if best is None else min(best, c)
    return best


def test_plan_matches_a_brute_force_search():
    for n in range(1, 13):
        for s in range(0, 5):
            lengths = plan(n, s)
            assert sum(lengths) == n and len(lengths) <= s + 1
            assert sum(recompute_cost(m, s - j) for j, m in enumerate(lengths)) == planned_cost(n, s)
            assert planned_cost(n, s) == _brute_force(n, s), (n, s)
    assert plan(5, 10) == [1] * 5 and planned_cost(5, 10) == 0  # a slot per step: nothing to recompute
    assert plan(6, 0) == [6] and planned_cost(6, 0) == 15


def _state_bytes(B: int, m: int, n: int, r: int) -> int:
    return (m * r + r * r + n * r) * B * 8  # float64 factors X, S, V


@pytest.mark.parametrize("slots", [1, 2, 3, 5, 40])
def test_budget_is_kept_replays_recompute_the_planned_steps_and_gradients_are_exact(slots):
    B, m, n, r, steps = 2, 10, 8, 3, 24
    F0 = torch.randn(B, m, n, generator=torch.Generator().manual_seed(7), dtype=F64)
    budget = slots * _state_bytes(B, m, n, r)
    ctl = MemoryBudget(budget, tau_grad=1e-300)  # every reversal "fails": every segment replays
    block = LowRankODEBlock(Field(m, n, seed=8), rank=r, steps=steps, h=0.05, controller=ctl)
    rev = _grads(block, F0, True)
    st = block.last_stats
    assert st["peak_tape_bytes"] <= budget and st["tape_bytes"] <= budget
    assert st["checkpoints"] == len(plan(steps, slots - 1)) <= slots
    assert st["recomputed"] == planned_cost(steps, slots - 1)
    ref = _grads(block, F0, False)  # dense autograd through the stored graph
    for a, b in zip(rev, ref, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-11)


def test_each_segment_takes_the_cheaper_of_reversal_and_replay():
    """A reversed step costs `reverse_cost` forward steps of field evaluations (counted in the
    forward pass); a replay costs the binomial recomputation. With one slot (the input state
    only) a 20-step replay would recompute 190 steps, so the block reverses; with three slots
    replaying is cheaper, so it replays without trying the reverse. Gradients exact both ways."""
    B, m, n, r = 2, 10, 8, 3
    F0 = torch.randn(B, m, n, generator=torch.Generator().manual_seed(9), dtype=F64)
    for slots in (1, 3):
        block = LowRankODEBlock(Field(m, n, seed=10), rank=r, steps=20, h=0.05,
                                controller=MemoryBudget(slots * _state_bytes(B, m, n, r)))
        rev = _grads(block, F0, True)
        st = block.last_stats
        assert st["reloads"] == 0 and st["peak_tape_bytes"] <= slots * _state_bytes(B, m, n, r)
        lengths = plan(20, slots - 1)
        costs = [recompute_cost(k, slots - 1 - j) for j, k in enumerate(lengths)]
        chosen = [c for c, k in zip(costs, lengths, strict=True) if k > 1 and c < k * st["reverse_cost"]]
        assert st["replayed_by_cost"] == len(chosen) and st["recomputed"] == sum(chosen)
        if slots == 1:
            assert st["recomputed"] == 0 and 20 * st["reverse_cost"] < recompute_cost(20, 0)
        else:
            assert st["replayed_by_cost"] > 0
        ref = _grads(block, F0, False)
        for a, b in zip(rev, ref, strict=True):
            torch.testing.assert_close(a, b, rtol=1e-8, atol=1e-10)


def test_a_budget_below_one_state_is_refused_by_name():
    F0 = torch.randn(1, 6, 5, dtype=F64)
    block = LowRankODEBlock(Field(6, 5), rank=2, steps=4, h=0.1, controller=MemoryBudget(100))
    with pytest.raises(ValueError, match=r"MemoryBudget\(max_bytes=100\) holds no state"):
        block(LowRankState.from_dense(F0, 2))
    for bad in (0, -5, 1.5):
        with pytest.raises(ValueError, match="max_bytes"):
            MemoryBudget(bad)
