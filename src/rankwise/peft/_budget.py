"""An adapter budget (``AdapterConfig.budget``) as a parameter count, and the rank it starts at."""

from __future__ import annotations

from collections.abc import Sequence

from ..nn._budget import layer_cost
from ._config import lora_rank_of


def budget_params(budget: int | str, shapes: Sequence[tuple[int, int]]) -> int:
    """`budget` as a parameter count: an int as it is; ``"lora:R"`` as the trainable
    parameters of PEFT's LoRA at rank R on layers of these (out, in) `shapes`,
    Σ R · (in + out) (LoRA does not clamp R to min(out, in))."""
    r = lora_rank_of(budget)
    if r is None:
        return int(budget)
    return sum(r * (m + n) for m, n in shapes)


def uniform_rank(shapes: Sequence[tuple[int, int]], params: int, *, buffer: bool) -> int:
    """The largest rank r such that every layer at min(r, out, in) costs at most `params` in all
    (:func:`rankwise.nn._budget.layer_cost`, SDLRT's buffer counted at its largest with
    `buffer`). Raises ``ValueError`` when rank 1 everywhere does not fit."""
    def cost(r: int) -> int:
        return sum(layer_cost(m, n, min(r, m, n), buffer=buffer) for m, n in shapes)

    if cost(1) > params:
        raise ValueError(f"`budget` of {params:,} parameters cannot hold the {len(shapes)} adapted layers at "
                         f"rank 1: that costs {cost(1):,} (U, S, V{', and the buffer' if buffer else ''}); "
                         "give a larger budget or adapt fewer modules")
    top = max(min(m, n) for m, n in shapes)
    r = 1
    while r < top and cost(r + 1) <= params:
        r += 1
    return r
