"""The backward's policy: which strategy takes a segment back."""

import torch

from rankwise.ode import LowRankState
from rankwise.ode._backward import BinomialReplay, FullReplay, Reverse, Segment, choose
from rankwise.ode._revolve import recompute_cost

_S = LowRankState(torch.zeros(1, 4, 2), torch.eye(2)[None], torch.zeros(1, 3, 2))


def _kinds(plan):
    return [type(s) for s in plan]


def test_the_reverse_comes_first_with_the_replay_as_its_fallback():
    plan, by_cost = choose(Segment(0, 8, _S, None), frame_free=True, reverse_cost=11.0)
    assert _kinds(plan) == [Reverse, FullReplay] and not by_cost
    plan, by_cost = choose(Segment(0, 8, _S, 3), frame_free=True, reverse_cost=0.5)
    assert _kinds(plan) == [Reverse, BinomialReplay] and not by_cost


def test_a_loss_that_sees_the_frames_is_replayed():
    for slots, kind in ((None, FullReplay), (2, BinomialReplay)):
        plan, by_cost = choose(Segment(0, 8, _S, slots), frame_free=False, reverse_cost=0.1)
        assert _kinds(plan) == [kind] and not by_cost


def test_under_a_budget_the_cheaper_way_is_chosen_by_the_cost_model():
    """Replay where recompute_cost(n, slots) < (n − 1) × reverse_cost, as before the strategies
    were objects; a one-step segment is always reversed (from its checkpoint: no reverse)."""
    for n in (1, 2, 8, 30):
        for slots in (0, 1, 3):
            for cost in (0.5, 2.0, 11.0):
                plan, by_cost = choose(Segment(5, n, _S, slots), frame_free=True, reverse_cost=cost)
                cheaper = n > 1 and recompute_cost(n, slots) < (n - 1) * cost
                assert by_cost == cheaper and _kinds(plan) == ([BinomialReplay] if cheaper
                                                               else [Reverse, BinomialReplay])
