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


def _evaluations(block, F0) -> int:
    """Field evaluations in one backward (a forward hook counts the calls)."""
    calls = [0]
    handle = block.field.register_forward_pre_hook(lambda *a: calls.__setitem__(0, calls[0] + 1))
    try:
        loss = (block(F0.clone().requires_grad_(True)).dense() ** 2).sum()
        calls[0] = 0
        loss.backward()
    finally:
        handle.remove()
    return calls[0]


def test_each_segment_takes_the_cheaper_of_reversal_and_replay():
    """Counted independently (field calls in the backward): the shipped choice costs no more
    evaluations than replaying every segment, and with one slot (the input state only, where a
    20-step replay recomputes 190 steps) it reverses and costs fewer (592 against 661 here)."""
    B, m, n, r = 2, 10, 8, 3
    F0 = torch.randn(B, m, n, generator=torch.Generator().manual_seed(9), dtype=F64)
    for slots in (1, 2, 3, 6):
        budget = slots * _state_bytes(B, m, n, r)

        def block(tau, budget=budget):
            return LowRankODEBlock(Field(m, n, seed=10), rank=r, steps=20, h=0.05,
                                   controller=MemoryBudget(budget, tau_grad=tau))

        shipped, replay = block(None), block(1e-300)
        e_shipped, e_replay = _evaluations(shipped, F0), _evaluations(replay, F0)
        assert e_shipped <= e_replay, (slots, e_shipped, e_replay)
        st = shipped.last_stats
        assert st["reloads"] == 0 and st["peak_tape_bytes"] <= budget
        if slots == 1:
            assert st["recomputed"] == 0 and st["replayed_by_cost"] == 0 and e_shipped < e_replay
        shipped.field.zero_grad()  # (the counted backward left its gradients)
        rev = _grads(shipped, F0, True)
        ref = _grads(shipped, F0, False)
        for a, b in zip(rev, ref, strict=True):
            torch.testing.assert_close(a, b, rtol=1e-8, atol=1e-10)


def test_live_states_stay_within_the_budget_plus_working_states(monkeypatch):
    """Counted from the objects alive at every step's vector-Jacobian product (every state
    constructed and not yet freed, garbage included), not from the block's own bookkeeping: the
    states held never exceed the budget, plus the output and two working states."""
    import gc
    import weakref

    from rankwise.ode import _backward

    alive: weakref.WeakSet = weakref.WeakSet()
    made = LowRankState.__post_init__

    def tracked(self) -> None:
        made(self)
        alive.add(self)

    monkeypatch.setattr(LowRankState, "__post_init__", tracked)
    live: list[int] = []
    real = _backward._vjp

    def counting(*args, **kwargs):
        live.append(len(alive))
        return real(*args, **kwargs)

    monkeypatch.setattr(_backward, "_vjp", counting)
    B, m, n, r, steps = 2, 10, 8, 3, 24
    F0 = torch.randn(B, m, n, generator=torch.Generator().manual_seed(12), dtype=F64)
    for slots, tau in ((2, 1e-300), (1, None), (3, None)):
        block = LowRankODEBlock(Field(m, n, seed=13), rank=r, steps=steps, h=0.05,
                                controller=MemoryBudget(slots * _state_bytes(B, m, n, r), tau_grad=tau))
        x = F0.clone().requires_grad_(True)
        loss = (block(x).dense() ** 2).sum()
        gc.collect()
        before = len(alive)  # tape + output + caller's
        live.clear()
        loss.backward()
        extra = max(live) - (before - block.last_stats["checkpoints"])  # states beyond those outside the tape
        assert extra <= slots + 2, (slots, tau, max(live), before)
        del loss, x


def test_a_second_backward_works_for_other_controllers_and_is_refused_under_a_budget():
    from rankwise.ode import FixedController

    F0 = torch.randn(2, 10, 8, generator=torch.Generator().manual_seed(14), dtype=F64, requires_grad=True)
    block = LowRankODEBlock(Field(10, 8, seed=15), rank=3, steps=8, h=0.05, controller=FixedController(3, 3))
    loss = (block(F0).dense() ** 2).sum()
    loss.backward(retain_graph=True)
    first = F0.grad.clone()
    loss.backward()
    torch.testing.assert_close(F0.grad, 2 * first)
    block.controller = MemoryBudget(3 * _state_bytes(2, 10, 8, 3))
    loss = (block(F0).dense() ** 2).sum()
    loss.backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="backward through the same forward twice"):
        loss.backward()


def test_a_budget_below_one_state_is_refused_by_name():
    F0 = torch.randn(1, 6, 5, dtype=F64)
    block = LowRankODEBlock(Field(6, 5), rank=2, steps=4, h=0.1, controller=MemoryBudget(100))
    with pytest.raises(ValueError, match=r"MemoryBudget\(max_bytes=100\) holds no state"):
        block(LowRankState.from_dense(F0, 2))
    for bad in (0, -5, 1.5):
        with pytest.raises(ValueError, match="max_bytes"):
            MemoryBudget(bad)
    for kw in ({}, {"max_bytes": 100, "max_states": 2}, {"max_states": 0}, {"max_states": True}):
        with pytest.raises(ValueError, match="max_"):
            MemoryBudget(**kw)


def test_a_budget_in_states_keeps_its_count_for_every_batch_size():
    """In bytes, a smaller batch gets more checkpoints; in states it gets the same schedule,
    which is the byte budget's at the batch the bytes were sized for."""
    m, n, r, steps = 10, 8, 3, 24
    field = Field(m, n, seed=16)

    def checkpoints(ctl, B):
        block = LowRankODEBlock(field, rank=r, steps=steps, h=0.05, controller=ctl)
        F0 = torch.randn(B, m, n, generator=torch.Generator().manual_seed(17), dtype=F64)
        block(LowRankState.from_dense(F0, r))
        tape = block.last_tape
        return tape.lengths, tape.replay_slots

    states, by_bytes = MemoryBudget(max_states=4), MemoryBudget(4 * _state_bytes(4, m, n, r))
    assert checkpoints(states, 4) == checkpoints(by_bytes, 4) == checkpoints(states, 1)
    assert len(checkpoints(by_bytes, 1)[0]) > len(checkpoints(states, 1)[0])
