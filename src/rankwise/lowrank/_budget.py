r"""A global parameter budget for low-rank layers, as pure functions.

A layer of shape (m, n) stored at rank r costs ``r (m + n) + r²`` parameters (U, V and the
r×r core S). Given every layer's singular values — the spectrum of its augmented core S̄ at a
truncation step — :func:`allocate_ranks` decides model-wide which singular directions are worth
their parameters; :func:`budget_schedule` lowers the budget gradually from where training
starts to the target.

**Which directions are worth keeping.** Direction i of layer ℓ carries the share
``σ_i² / ‖σ‖²`` of that layer's energy (its squared Frobenius norm); keeping it costs about
``m + n`` parameters. Directions are kept in decreasing order of *energy share per parameter*,
``σ_i² / (‖σ‖² (m + n))``, until the budget is spent. Shares rather than raw σ² make the rule
invariant to each layer's scale (a layer whose weights are 10× larger is not 100× more
important); dividing by m + n makes a direction of a wide layer pay for its size. Within a layer
the scores decrease with i, so every layer keeps a leading block of its spectrum, exactly what
truncating its SVD does. With equal layer sizes this is one relative threshold on σ_i/‖σ‖
shared by all layers — a global τ chosen by the budget instead of by hand.
"""

from __future__ import annotations

from collections.abc import Mapping

from torch import Tensor


def factor_cost(m: int, n: int, r: int) -> int:
    """Parameters of a rank-r factorisation of an (m, n) weight: U, V and the r×r core."""
    return r * (m + n) + r * r


def allocate_ranks(spectra: Mapping[str, Tensor], shapes: Mapping[str, tuple[int, int]], budget: float,
                   *, min_rank: int = 1, max_ranks: Mapping[str, int] | None = None) -> dict[str, int]:
    """Ranks for every layer whose total :func:`factor_cost` fits in `budget`.

    **Arguments:**
    - `spectra`: layer name -> its singular values (k,), in decreasing order.
    - `shapes`: layer name -> (m, n) of its weight matrix.
    - `budget`: parameters available to these layers' factors (U, S, V).
    - `min_rank`: every layer keeps at least this many directions (if its spectrum has them),
      whatever the budget; `max_ranks`: per-layer caps (default: the spectrum length).

    **Returns:** layer name -> rank. Directions are taken in decreasing order of
    ``σ_i² / (‖σ‖² (m + n))`` (see the module docstring) while they fit; a direction that does
    not fit closes its layer, and cheaper directions of other layers may still be taken, so no
    further direction of any open layer fits when this returns. If the minimum ranks alone
    exceed the budget they are returned as they are.
    """
    if set(spectra) != set(shapes):
        raise ValueError(f"`spectra` and `shapes` must name the same layers; got {sorted(spectra)} "
                         f"and {sorted(shapes)}")
    if min_rank < 0:
        raise ValueError(f"`min_rank` must be >= 0; got {min_rank}")
    caps = {name: s.numel() for name, s in spectra.items()}
    if max_ranks is not None:
        caps = {name: min(c, max(int(max_ranks.get(name, c)), 0)) for name, c in caps.items()}
    ranks = {name: min(min_rank, caps[name]) for name in spectra}
    spent = sum(factor_cost(*shapes[name], r) for name, r in ranks.items())
    candidates: list[tuple[float, str, int]] = []
    for name, s in spectra.items():
        m, n = shapes[name]
        energy = s.detach().double().square()
        total = float(energy.sum())
        if total <= 0.0:
            continue
        scores = (energy / (total * (m + n))).tolist()
        candidates += [(scores[i], name, i) for i in range(ranks[name], caps[name])]
    candidates.sort(key=lambda c: -c[0])
    closed: set[str] = set()
    for _, name, i in candidates:
        if name in closed or i != ranks[name]:
            continue
        m, n = shapes[name]
        extra = factor_cost(m, n, i + 1) - factor_cost(m, n, i)
        if spent + extra > budget:
            closed.add(name)
            continue
        ranks[name] = i + 1
        spent += extra
    return ranks


def budget_schedule(step: int, total_steps: int, start: float, target: float, *,
                    warmup: float = 0.1, final: float = 0.2) -> float:
    """The budget at `step` of `total_steps`: `start` during the first `warmup` share of the
    steps, `target` during the last `final` share, and in between a cubic decrease
    ``target + (start − target) (1 − progress)³`` (AdaLoRA's schedule: it prunes fast while
    the spectra still carry much small energy, then slowly, so that the last cuts are made
    with the most training behind them)."""
    if total_steps < 1:
        raise ValueError(f"`total_steps` must be >= 1; got {total_steps}")
    if not (warmup >= 0 and final >= 0 and warmup + final < 1):
        raise ValueError(f"need warmup >= 0, final >= 0 and warmup + final < 1; got {warmup}, {final}")
    t_i, t_f = warmup * total_steps, (1 - final) * total_steps
    if step <= t_i:
        return float(start)
    if step >= t_f:
        return float(target)
    progress = (step - t_i) / (t_f - t_i)
    return float(target + (start - target) * (1 - progress) ** 3)
