"""Global rank allocation under a parameter budget, and the budget schedule."""

from __future__ import annotations

import itertools

import pytest
import torch

from rankwise.nn._budget import RULES, allocate_ranks, budget_schedule, factor_cost

SPECTRAL = [r for r in RULES if r != "uniform"]  # the rules that read the spectra

F64 = torch.float64


def _cost(shapes, ranks) -> int:
    return sum(factor_cost(*shapes[n], r) for n, r in ranks.items())


@pytest.mark.parametrize("rule", SPECTRAL)
def test_slowly_decaying_spectrum_gets_more_rank(rule):
    fast = 0.5 ** torch.arange(32, dtype=F64)               # energy in the first few directions
    slow = 1.0 / torch.arange(1, 33, dtype=F64).sqrt()       # energy spread out
    shapes = {"fast": (32, 32), "slow": (32, 32)}
    budget = factor_cost(32, 32, 12) * 2 * 0.5               # ≈ 12 directions in all
    ranks = allocate_ranks({"fast": fast, "slow": slow}, shapes, budget, rule=rule)
    assert ranks["slow"] > ranks["fast"] >= 1
    assert _cost(shapes, ranks) <= budget


@pytest.mark.parametrize("budget", [0, 500, 3_000, 10_000, 1e9])
def test_budget_is_respected_and_no_direction_that_fits_is_left(budget):
    g = torch.Generator().manual_seed(0)
    shapes = {"a": (20, 30), "b": (64, 8), "c": (40, 40)}
    spectra = {n: torch.rand(min(s), generator=g, dtype=F64).sort(descending=True).values
               for n, s in shapes.items()}
    ranks = allocate_ranks(spectra, shapes, budget, min_rank=1)
    assert all(r >= 1 for r in ranks.values())
    if _cost(shapes, {n: 1 for n in shapes}) <= budget:
        assert _cost(shapes, ranks) <= budget
    for name, r in ranks.items():  # maximal: one more direction anywhere would not fit
        if r < spectra[name].numel():
            assert _cost(shapes, {**ranks, name: r + 1}) > budget


@pytest.mark.parametrize("rule", SPECTRAL)
def test_within_five_percent_of_brute_force_on_small_problems(rule):
    """Greedy selection against an exhaustive search over every rank combination that fits
    (the optimum of the same objective, written out independently: the sum over layers of
    what the kept directions buy per parameter, as the module docstring defines it): a
    knapsack greedy is not optimal in general, but here it stays within 5 % of the optimum."""
    g = torch.Generator().manual_seed(3)
    shapes = {"a": (6, 4), "b": (5, 5), "c": (3, 7)}
    spectra = {n: torch.rand(4, generator=g, dtype=F64).sort(descending=True).values for n in shapes}
    # and layers of unequal widths and spectrum lengths (a wide one with a long flat spectrum)
    wide = {"w": (40, 120), "m": (8, 12), "s": (6, 15)}
    wide_spectra = {"w": 1 + 0.1 * torch.rand(8, generator=g, dtype=F64).sort(descending=True).values,
                    "m": torch.rand(8, generator=g, dtype=F64).sort(descending=True).values,
                    "s": 0.5 ** torch.arange(6, dtype=F64)}

    def score(name, r):
        s, cost = spectra[name].square(), sum(shapes[name])
        if rule == "energy":
            return float(s[:r].sum() / s.sum()) / cost
        err = float(s[r:].sum() / s.sum()) ** 0.5  # relative error at rank r; 1 at r = 0
        return (1 - err) / (cost ** 0.5 if rule == "error-sqrt" else cost)

    cases = [(shapes, spectra, b) for b in (25, 60, 100, 150)]
    cases += [(wide, wide_spectra, b) for b in (400, 900, 1500)]
    for shapes, spectra, budget in cases:  # (score reads the current shapes, spectra)
        ranks = allocate_ranks(spectra, shapes, budget, min_rank=0, rule=rule)
        best = max((sum(score(n, r) for n, r in zip(shapes, rs, strict=True)), rs)
                   for rs in itertools.product(*(range(len(spectra[n]) + 1) for n in shapes))
                   if _cost(shapes, dict(zip(shapes, rs, strict=True))) <= budget)
        got = sum(score(n, r) for n, r in ranks.items())
        assert got >= best[0] - 0.05 * best[0]  # greedy knapsack: within 5 % of the optimum here


@pytest.mark.parametrize("rule", SPECTRAL)
def test_scale_of_a_layer_does_not_change_its_share(rule):
    g = torch.Generator().manual_seed(1)
    shapes = {"a": (16, 16), "b": (16, 16)}
    spectra = {n: torch.rand(16, generator=g, dtype=F64).sort(descending=True).values for n in shapes}
    ranks = allocate_ranks(spectra, shapes, 400, rule=rule)
    scaled = allocate_ranks({"a": 100 * spectra["a"], "b": spectra["b"]}, shapes, 400, rule=rule)
    assert ranks == scaled


def test_bad_arguments():
    with pytest.raises(ValueError, match="same layers"):
        allocate_ranks({"a": torch.ones(3)}, {"b": (3, 3)}, 10)
    with pytest.raises(ValueError, match="rule"):
        allocate_ranks({"a": torch.ones(3)}, {"a": (3, 3)}, 10, rule="sqrt")
    with pytest.raises(ValueError, match="total_steps"):
        budget_schedule(0, 0, 10, 1)


def test_schedule_warmup_cubic_decrease_and_final_phase():
    T, start, target = 100, 1000.0, 100.0
    values = [budget_schedule(t, T, start, target, warmup=0.1, final=0.2) for t in range(T + 1)]
    assert values[0] == values[10] == start and values[80] == values[100] == target
    assert all(a >= b for a, b in itertools.pairwise(values))  # never increases
    mid = budget_schedule(45, T, start, target, warmup=0.1, final=0.2)  # progress 0.5
    assert mid == pytest.approx(target + (start - target) * 0.125)


def test_uniform_gives_every_layer_one_rank_until_it_is_capped():
    """The "uniform" rule ignores the spectra: equal ranks (the cheapest of equals first), a
    capped layer drops out and the others go on; compared with a hand count."""
    g = torch.Generator().manual_seed(2)
    shapes = {"a": (30, 30), "b": (60, 20), "small": (4, 6)}
    spectra = {n: torch.rand(min(s), generator=g, dtype=F64).sort(descending=True).values
               for n, s in shapes.items()}
    ranks = allocate_ranks(spectra, shapes, 10 * 60 + 10 * 80 + 4 * 10 + 10 ** 2 * 2 + 16, rule="uniform")
    assert ranks == {"a": 10, "b": 10, "small": 4}  # small is capped at 4; a, b share the rest equally
    assert allocate_ranks({n: 1e3 * s for n, s in spectra.items()}, shapes, 2_000, rule="uniform") == \
        allocate_ranks(spectra, shapes, 2_000, rule="uniform")
    zero = {n: torch.zeros_like(s) for n, s in spectra.items()}  # e.g. zero-initialised layers
    assert allocate_ranks(zero, shapes, 2_000, rule="uniform") == allocate_ranks(spectra, shapes, 2_000,
                                                                                rule="uniform")
    with pytest.raises(ValueError, match="NaN"):
        allocate_ranks(spectra, shapes, float("nan"))
