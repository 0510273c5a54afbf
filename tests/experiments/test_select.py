"""The fair protocol's configuration choice on validation (rankwise.experiments._select)."""

from __future__ import annotations

import pytest

from rankwise.experiments._select import DEFAULT_GRID, choose, parse_grid, select, widened


def test_choose_takes_the_best_mean_validation_and_names_the_edge():
    grid = {"sgd": (0.01, 0.1, 1.0), "adam": (1e-3, 1e-2)}
    scores = {("sgd", 0.01): [0.5, 0.7], ("sgd", 0.1): [0.8, 0.8], ("sgd", 1.0): [0.1],
              ("adam", 1e-3): [0.7], ("adam", 1e-2): [0.85, 0.75]}
    c = choose(scores, grid)
    assert (c.optimizer, c.lr, c.at_edge) == ("sgd", 0.1, "")
    assert len(c.tried) == 5
    scores[("adam", 1e-2)] = [0.9]
    c = choose(scores, grid)
    assert (c.optimizer, c.lr, c.at_edge) == ("adam", 1e-2, "high")
    tie = choose({("sgd", 0.01): [0.5], ("sgd", 0.1): [0.5]}, {"sgd": (0.01, 0.1)})
    assert tie.lr == 0.01  # ties: the earlier in the grid


def test_widened_adds_one_value_at_the_grids_own_ratio():
    assert widened({"sgd": (0.01, 0.03, 0.1)}, "sgd", "high")["sgd"] == (0.01, 0.03, 0.1, 0.333)
    assert widened({"adam": (1e-3, 1e-2)}, "adam", "low")["adam"] == (1e-4, 1e-3, 1e-2)


def test_select_widens_at_an_edge_and_reads_only_validation():
    """A validation accuracy that peaks at lr 1.0, beyond the grid: the first round picks the
    top edge, the widened round moves past it; test accuracy (adversarial here) is ignored."""
    calls: list[list[tuple]] = []

    def run(specs):
        calls.append(specs)
        return [{"val_acc": -abs(lr - 1.0), "test_acc": lr} for (_, family, lr) in specs]

    choices = select({"a": ("a", None, None)}, {"sgd": (0.01, 0.03, 0.1, 0.3)},
                     lambda s, f, lr: (s[0], f, lr), run, widen=2)
    c = choices["a"]
    assert c.optimizer == "sgd" and c.lr == pytest.approx(0.9, rel=0.01)
    assert c.at_edge == ""  # 0.9 won against the second widening's 2.7
    assert [len(x) for x in calls] == [4, 5, 6]
    far = select({"a": ("a", None, None)}, {"sgd": (0.01, 0.1)}, lambda s, f, lr: (s[0], f, lr),
                 lambda specs: [{"val_acc": lr} for (_, _, lr) in specs], widen=1)["a"]
    assert (far.lr, far.at_edge) == (1.0, "high")  # still at the edge after one widening: reported


def test_parse_grid():
    assert parse_grid("sgd:0.1,0.01; adam:1e-3,3e-3") == {"sgd": (0.01, 0.1), "adam": (1e-3, 3e-3)}
    for bad in ("", "sgd", "sgd:0.1", "sgd:0.1,x", "sgd:0.1,-1", ":0.1,0.2"):
        with pytest.raises(ValueError):
            parse_grid(bad)
    assert all(len(v) >= 4 for v in DEFAULT_GRID.values())
