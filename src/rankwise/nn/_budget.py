r"""A global parameter budget for low-rank layers, as pure functions.

A layer of shape (m, n) stored at rank r costs ``r (m + n) + r²`` parameters (U, V and the
r×r core S). Given every layer's singular values — the spectrum of its augmented core S̄ at a
truncation step — :func:`allocate_ranks` decides model-wide which singular directions are worth
their parameters; :func:`budget_schedule` lowers the budget gradually from where training
starts to the target.

**Which directions are worth keeping.** Greedily, the next direction of the layer where it buys
the most per parameter, until the budget is spent. What it buys is measured relative to the
layer, so that the rule is invariant to each layer's scale (a layer whose weights are 10× larger
is not 100× more important): with ``e_r = ‖σ_{r:}‖ / ‖σ‖`` the relative error of keeping r
directions (‖W − W_r‖_F / ‖W‖_F),

- ``"error-sqrt"`` (default): ``(e_r − e_{r+1}) / √(m + n)``;
- ``"error"``: ``(e_r − e_{r+1}) / (m + n)``: the greedy step for the smallest sum of the layers'
  relative errors (a first-order bound on the network's relative output error) per parameter;
- ``"energy"``: ``σ_r² / (‖σ‖² (m + n))``, the share of the layer's squared norm per parameter;
- ``"sensitivity"`` (training only: it reads the loss gradient): what removing the direction
  would cost the loss, smoothed over steps, per parameter (:mod:`._sensitivity`); the
  caller passes the scores;
- ``"uniform"``: no spectrum: one rank for every layer (the lowest grows first, the cheapest
  of equals first; a layer whose rank is capped drops out), what a user who factorises every
  layer at one rank r does.

Dividing by √(m + n) instead of m + n still charges wide layers more, but less than in
proportion: "energy" and "error" starve the large layers of LeNet (a direction of its 500-wide
fc1 costs 15× one of the 20×25 first conv). The default is a measured choice, not a derived
one; the comparison is in docs/sdlrt.md ("Compression you can ask for").

All three spectral rules see each layer's whole spectrum, so a long flat spectrum (a random
initialisation's) makes each of its directions worth little: converting a random 500×200
layer in one shot (`to_low_rank(target=...)`) gives it a tiny rank. During DLRT training the
spectra are those of the augmented cores (at most 2r long), where this matters less.
"""

from __future__ import annotations

import heapq
from collections.abc import Mapping, Sequence

import torch
from torch import Tensor


def factor_cost(m: int, n: int, r: int) -> int:
    """Parameters of a rank-r factorisation of an (m, n) weight: U, V and the r×r core."""
    return r * (m + n) + r * r


def layer_cost(m: int, n: int, r: int, *, buffer: bool = False) -> int:
    """What a rank-r layer holds: :func:`factor_cost`, plus with `buffer` SDLRT's compensation
    buffer at its largest (b = r directions, U_buf (m, r) and V_buf (n, r))."""
    return factor_cost(m, n, r) + (r * (m + n) if buffer else 0)


RULES = ("error-sqrt", "error", "energy", "uniform")  # rules that need only the spectra (one-shot)
# rules a training budget may use: also "sensitivity", which reads the loss gradient
# (rankwise.optim._sensitivity); public as rankwise.nn.ALLOCATION_RULES
TRAINING_RULES = (*RULES, "sensitivity")
ALLOCATION_RULES = TRAINING_RULES


def _scores(s: Tensor, m: int, n: int, rule: str) -> list[float]:
    """Score of adding direction r (r = 0 … k−1) to a layer with singular values `s`; none
    (an empty list: nothing to gain) for a zero spectrum under the spectral rules."""
    if rule == "uniform":  # the spectrum only caps the rank: the lowest rank grows first, cheapest first
        return [-(i + (m + n) * 1e-9) for i in range(s.numel())]
    energy = s.detach().double().square()
    total = float(energy.sum())
    if total <= 0.0:
        return []
    if rule == "energy":
        return (energy / (total * (m + n))).tolist()
    tails = energy.flip(0).cumsum(0).flip(0)  # ‖σ_{r:}‖², r = 0 … k−1
    err = (tails / total).sqrt()
    gain = err - torch.cat([err[1:], err.new_zeros(1)])  # e_r − e_{r+1}
    return (gain / ((m + n) ** 0.5 if rule == "error-sqrt" else (m + n))).tolist()


def allocate_ranks(spectra: Mapping[str, Tensor], shapes: Mapping[str, tuple[int, int]], budget: float,
                   *, min_rank: int | Mapping[str, int] = 1, max_ranks: Mapping[str, int] | None = None,
                   rule: str = "error-sqrt", scores: Mapping[str, Sequence[float]] | None = None,
                   buffer: bool = False) -> dict[str, int]:
    """Ranks for every layer whose total :func:`factor_cost` fits in `budget`.

    **Arguments:**
    - `spectra`: layer name -> its singular values (k,), in decreasing order.
    - `shapes`: layer name -> (m, n) of its weight matrix.
    - `budget`: parameters available to these layers' factors (U, S, V).
    - `min_rank`: every layer keeps at least this many directions (if its spectrum has them),
      whatever the budget; an int for every layer or a mapping (layer -> floor; missing
      layers: 1). `max_ranks`: per-layer caps (default: the spectrum length).
    - `rule`: what a direction buys (module docstring): ``"error-sqrt"``, ``"error"``,
      ``"energy"`` or ``"uniform"``; ``"sensitivity"`` takes the scores from `scores`.
    - `scores`: with ``rule="sensitivity"``, layer name -> the score of each of its
      directions in the order they would be kept (e.g. :func:`._sensitivity.scores`), per
      parameter already.
    - `buffer`: cost each layer with SDLRT's buffer counted (:func:`layer_cost`).

    **Returns:** layer name -> rank. Repeatedly, of every layer's *next* direction the one with
    the highest score is added if it fits; one that does not fit closes its layer, and the
    others may still grow, so no further direction of any open layer fits when this returns.
    If the minimum ranks alone exceed the budget they are returned as they are.
    """
    if set(spectra) != set(shapes):
        raise ValueError(f"`spectra` and `shapes` must name the same layers; got {sorted(spectra)} "
                         f"and {sorted(shapes)}")
    floors = dict(min_rank) if isinstance(min_rank, Mapping) else dict.fromkeys(spectra, min_rank)
    if any(f < 0 for f in floors.values()):
        raise ValueError(f"`min_rank` must be >= 0; got {min_rank}")
    if rule not in TRAINING_RULES:
        raise ValueError(f"`rule` must be one of {TRAINING_RULES}; got {rule!r}")
    if (rule == "sensitivity") != (scores is not None):
        raise ValueError("`scores` are given with rule='sensitivity', and only then")
    if budget != budget:  # NaN
        raise ValueError("`budget` is NaN")
    caps = {name: s.numel() for name, s in spectra.items()}
    if max_ranks is not None:
        caps = {name: min(c, max(int(max_ranks.get(name, c)), 0)) for name, c in caps.items()}
    ranks = {name: min(floors.get(name, 1), caps[name]) for name in spectra}
    spent = sum(layer_cost(*shapes[name], r, buffer=buffer) for name, r in ranks.items())
    if scores is not None:
        scores = {name: list(scores[name]) for name in spectra}
    else:
        scores = {name: _scores(s, *shapes[name], rule) for name, s in spectra.items()}
    heap = [(-scores[name][ranks[name]], name) for name in scores
            if ranks[name] < min(caps[name], len(scores[name]))]
    heapq.heapify(heap)
    while heap:
        _, name = heapq.heappop(heap)
        m, n = shapes[name]
        r = ranks[name]
        extra = layer_cost(m, n, r + 1, buffer=buffer) - layer_cost(m, n, r, buffer=buffer)
        if spent + extra > budget:
            continue  # closed: larger ranks of this layer cost more still
        ranks[name], spent = r + 1, spent + extra
        if r + 1 < min(caps[name], len(scores[name])):
            heapq.heappush(heap, (-scores[name][r + 1], name))
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


def tail_share(s: Tensor, rank: int) -> float:
    """‖s[rank:]‖ / ‖s‖ (0 for s = 0): the relative tail a truncation to `rank` discards, i.e.
    the tolerance τ that would have given that rank (s: singular values, on the host)."""
    s = s.double()
    total = float(s.norm())
    return float(s[rank:].norm()) / total if total > 0 else 0.0
