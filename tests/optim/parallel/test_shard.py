"""The sharded integrator's owner assignment: a pure function of the layers' costs, balanced
within the longest-processing-time bound of the best assignment (brute force); the state
travels as a structure plus tensors. (Training with it: tests/optim/parallel/test_dp.py.)"""

from __future__ import annotations

import itertools
import random

import pytest
import torch

from rankwise.optim.parallel._shard import _join, _split, assign_owners, integration_cost


def _makespan(costs: dict[str, float], owners: dict[str, int], world: int) -> float:
    load = [0.0] * world
    for n, r in owners.items():
        load[r] += costs[n]
    return max(load)


@pytest.mark.parametrize("seed", range(20))
@pytest.mark.parametrize("world", [2, 3])
def test_owners_are_within_the_lpt_bound_of_the_best_assignment(seed, world):
    rnd = random.Random(seed)
    costs = {f"l{i}": float(rnd.choice([1, 2, 3, 5, 8, 13]) * rnd.randint(1, 9))
             for i in range(rnd.randint(1, 7))}
    owners = assign_owners(costs, world)
    assert list(owners) == list(costs) and set(owners.values()) <= set(range(world))
    best = min(_makespan(costs, dict(zip(costs, a, strict=True)), world)
               for a in itertools.product(range(world), repeat=len(costs)))
    assert _makespan(costs, owners, world) <= (4 / 3 - 1 / (3 * world)) * best + 1e-9  # Graham's bound
    assert assign_owners(dict(costs), world) == owners  # deterministic


def test_equal_layers_are_spread_evenly():
    costs = {f"l{i}": integration_cost(1024, 1024, 52) for i in range(4)}
    assert assign_owners(costs, 2) == {"l0": 0, "l1": 1, "l2": 0, "l3": 1}
    assert assign_owners(costs, 4) == {"l0": 0, "l1": 1, "l2": 2, "l3": 3}
    assert assign_owners(costs, 1) == dict.fromkeys(costs, 0)
    with pytest.raises(ValueError, match="world"):
        assign_owners(costs, 0)


def test_split_and_join_round_trip_a_nested_state():
    state = {"K": {"m": torch.randn(3, 2)}, "S": {}, "tau": 0.1,
             "sensitivity": [torch.ones(2), torch.zeros(2)], "r_init": 3, "pair": (torch.arange(4), "x")}
    tensors: list = []
    skeleton = _split(state, tensors)
    assert len(tensors) == 4 and not any(torch.is_tensor(v) for v in _leaves(skeleton))
    back = _join(skeleton, tensors)
    assert back.keys() == state.keys() and back["tau"] == 0.1 and back["pair"][1] == "x"
    assert torch.equal(back["K"]["m"], state["K"]["m"]) and torch.equal(back["pair"][0], state["pair"][0])


def _leaves(v):
    if isinstance(v, dict):
        for x in v.values():
            yield from _leaves(x)
    elif isinstance(v, list):
        for x in v:
            yield from _leaves(x)
    else:
        yield v
