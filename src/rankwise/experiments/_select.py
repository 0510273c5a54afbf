"""Choosing each method's training configuration on validation: the fair protocol of
``rankwise sweep --select`` and ``rankwise peft``.

Every method gets the same grid: each optimizer family with its own log-spaced learning rates.
The configuration with the best validation accuracy wins (ties: the earlier in the grid); when
the winning learning rate sits at an edge of its family's values, the grid is widened on that
side by one value (the grid's own ratio) and the choice made again, up to `widen` times. A
choice still at an edge is reported as such. Test accuracy is never read here.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Hashable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

S = TypeVar("S")

# learning rates per optimizer family (log-spaced, ratio about 3)
DEFAULT_GRID: dict[str, tuple[float, ...]] = {"sgd": (0.01, 0.03, 0.1, 0.3), "adam": (3e-4, 1e-3, 3e-3, 1e-2)}


@dataclass(frozen=True)
class Choice:
    """The configuration chosen for one group: optimizer family, learning rate, its mean
    validation accuracy, whether it sits at an edge of the values tried (``at_edge``: "low",
    "high" or ""), and every (optimizer, lr, mean val acc) tried, in grid order."""

    optimizer: str
    lr: float
    val_acc: float
    at_edge: str
    tried: tuple[tuple[str, float, float], ...]


def parse_grid(text: str, families: Sequence[str] | None = None) -> dict[str, tuple[float, ...]]:
    """``"sgd:0.01,0.03,0.1,0.3;adam:3e-4,1e-3"`` -> {family: learning rates, ascending}; a
    family not in `families` (when given) is refused before its rates are read."""
    grid: dict[str, tuple[float, ...]] = {}
    for part in (p.strip() for p in text.split(";") if p.strip()):
        family, sep, values = part.partition(":")
        if not sep or not family.strip():
            raise ValueError(f"a grid entry is FAMILY:LR,LR,...; got {part!r}")
        if families is not None and family.strip() not in families:
            raise ValueError(f"families must be from {', '.join(families)}; got {family.strip()!r}")
        try:
            lrs = sorted(float(v) for v in values.split(",") if v.strip())
        except ValueError:
            raise ValueError(f"learning rates must be numbers; got {values!r}") from None
        if len(lrs) < 2 or not all(math.isfinite(v) and v > 0 for v in lrs) or len(set(lrs)) != len(lrs):
            raise ValueError(f"{family.strip()}: give at least two distinct positive learning rates; "
                             f"got {values!r}")
        if family.strip() in grid:
            raise ValueError(f"{family.strip()} is given twice; give each family once")
        grid[family.strip()] = tuple(lrs)
    if not grid:
        raise ValueError("the grid is empty")
    return grid


def _mean(xs: Sequence[float]) -> float:
    xs = [x for x in xs if not math.isnan(x)]
    return sum(xs) / len(xs) if xs else -math.inf


def choose(scores: Mapping[tuple[str, float], Sequence[float]],
           grid: Mapping[str, Sequence[float]]) -> Choice:
    """The best (optimizer, lr) of `scores` ({(optimizer, lr): validation accuracies}) by mean
    validation accuracy; `grid`: the values tried per family (for the edge)."""
    order = [(f, lr) for f, lrs in grid.items() for lr in sorted(lrs) if (f, lr) in scores]
    if not order:
        raise ValueError("nothing to choose from: no run of the grid has a result")
    tried = tuple((f, lr, _mean(scores[(f, lr)])) for f, lr in order)
    best = max(range(len(tried)), key=lambda i: (tried[i][2], -i))
    family, lr, val = tried[best]
    lrs = sorted(grid[family])
    edge = "low" if lr == lrs[0] else "high" if lr == lrs[-1] else ""
    return Choice(family, lr, val, edge, tried)


def widened(grid: Mapping[str, Sequence[float]], family: str, side: str) -> dict[str, tuple[float, ...]]:
    """`grid` with one more value of `family` beyond its `side` ("low"/"high") edge, at the
    ratio of its two outermost values on that side."""
    lrs = sorted(grid[family])
    new = lrs[0] * lrs[0] / lrs[1] if side == "low" else lrs[-1] * lrs[-1] / lrs[-2]
    return {**grid, family: tuple(sorted([*lrs, float(f"{new:.3g}")]))}


def select(groups: Mapping[Hashable, S], grid: Mapping[str, Sequence[float]],
           configure: Callable[[S, str, float], S], run: Callable[[list[S]], list[dict[str, Any]]], *,
           widen: int = 1, val_key: str = "val_acc") -> dict[Hashable, Choice]:
    """Choose a configuration for every group on validation.

    **Arguments:**
    - `groups`: group -> the spec to tune (e.g. one per task and method, at seed 0 of the
      selection setting).
    - `grid`: optimizer family -> learning rates (:data:`DEFAULT_GRID`).
    - `configure(spec, optimizer, lr)`: the spec trained with that configuration.
    - `run(specs)`: trains (or reads back) the specs and returns their records, in order,
      each with ``val_acc`` (resumable runners make a repeated selection free).
    - `widen`: how many times a group's grid may grow at an edge.

    **Returns:** group -> :class:`Choice`.
    """
    grids = {g: {f: tuple(sorted(v)) for f, v in grid.items()} for g in groups}
    choices: dict[Hashable, Choice] = {}
    pending = list(groups)
    for round_ in range(widen + 1):
        specs, owners = [], []
        for g in pending:
            for family, lrs in grids[g].items():
                for lr in lrs:
                    specs.append(configure(groups[g], family, lr))
                    owners.append((g, family, lr))
        records = run(specs)
        scores: dict[Hashable, dict[tuple[str, float], list[float]]] = {g: {} for g in pending}
        for (g, family, lr), rec in zip(owners, records, strict=True):
            scores[g].setdefault((family, lr), []).append(float(rec[val_key]))
        nxt = []
        for g in pending:
            choices[g] = choose(scores[g], grids[g])
            if choices[g].at_edge and round_ < widen:
                grids[g] = widened(grids[g], choices[g].optimizer, choices[g].at_edge)
                nxt.append(g)
        pending = nxt
        if not pending:
            break
    return choices


def choices_markdown(rows: Sequence[tuple[str, str, Choice]], where: str) -> str:
    """A table of the choices: (setting, method, :class:`Choice`) per row; `where` says on
    what they were made."""
    lines = [f"Configuration chosen {where}: the best mean validation accuracy of the grid.", "",
             "| setting | method | optimizer | lr | val acc | at grid edge | tried (optimizer lr: val acc) |",
             "|---|---|---|---|---|---|---|"]
    for setting, method, c in rows:
        tried = ", ".join(f"{f} {lr:g}: {v:.3f}" for f, lr, v in c.tried)
        lines.append(f"| {setting} | {method} | {c.optimizer} | {c.lr:g} | {c.val_acc:.4f} | "
                     f"{c.at_edge or 'no'} | {tried} |")
    return "\n".join(lines) + "\n"
