"""How a step chooses each layer's new rank, as one object per kind of truncation, so that the step
itself never branches on the kind. Each answers three questions (and says what it needs read back):

- :meth:`Strategy.on_device`: the numbers for ranks chosen on the device, inside the group's plan
  (a tolerance's τ and bounds), or None;
- :meth:`Strategy.from_host`: the ranks chosen after the one read (a budget allocates model-wide
  from the cores' singular values), or nothing, keeping the device's (or the old) ranks;
- :meth:`Strategy.after_commit`: what a layer's state keeps of it (SDLRT's τ feedback, a budget's
  tail, the data-aware budget's smoothed sensitivities).

The user-facing policies (:class:`._policies.Tolerance`, :class:`._policies.Budget`,
:class:`._policies.Feedback`) are frozen settings; :func:`strategy` turns them into one of these.
"""

from __future__ import annotations

import torch
from torch.optim import Optimizer

from ..nn._budget import tail_share
from . import functional
from ._batched import _Group, _stack
from .rules._settings import Settings


class Strategy:
    """Fixed ranks (``adaptive=False``): every layer keeps its rank."""

    spectra = False  # read each core's singular values back
    scores = False  # and their sensitivity scores

    def on_device(self, opt: Optimizer, g: _Group) -> functional.Ranks | None:
        return None

    def reorder(self, g: _Group) -> None:
        """After a group's plan: reorder its directions before the ranks are chosen (sensitivity)."""

    def from_host(self, opt: Optimizer, groups: list[_Group]) -> None:
        """After the read: set ``g.r1`` where the host chooses the ranks."""

    def after_commit(self, opt: Optimizer, g: _Group, i: int, st: dict) -> None:
        """What layer i of group `g` keeps in its state `st` of its new rank ``g.r1[i]``."""


class ToleranceStrategy(Strategy):
    """The smallest rank whose tail is ≤ τ‖s‖, on the device (:func:`._step.tolerance_ranks`,
    inside :func:`.functional.plan`), clamped to [min_rank, the layer's cap]; then SDLRT's
    feedback moves τ."""

    def __init__(self, settings: Settings) -> None:
        self.settings = settings

    def on_device(self, opt: Optimizer, g: _Group) -> functional.Ranks:
        dev, caps = g.plan_device, [opt._rank_cap(m) for m in g.layers]
        return functional.Ranks(torch.tensor([st["tau"] for st in g.states], dtype=torch.float64, device=dev),
                       torch.tensor([min(self.settings.min_rank, c) for c in caps], device=dev),
                       torch.tensor(caps, device=dev))

    def after_commit(self, opt: Optimizer, g: _Group, i: int, st: dict) -> None:
        feedback = self.settings.feedback
        if feedback is not None:
            st["tau"] = feedback(st["tau"], g.r1[i], st["r_init"], self.settings.tau)


class BudgetStrategy(Strategy):
    """A model-wide budget: the host allocates ranks from every core's singular values
    (:meth:`AugmentedBUG._budget_ranks`), each layer keeps its discarded tail's share."""

    spectra = True

    def from_host(self, opt: Optimizer, groups: list[_Group]) -> None:
        spectra, scores = {}, {}
        for g in groups:
            for i, n in enumerate(g.names):
                spectra[n] = g.spectra[i]
                if self.scores:
                    scores[n] = g.score_lists[i]
        spectra = {n: spectra[n] for n in opt.layers if n in spectra}  # (in the model's order)
        ranks = opt._budget_ranks(spectra, scores=scores if self.scores else None)
        for g in groups:
            g.r1 = [ranks[n] for n in g.names]
            g.tails = [tail_share(spectra[n], ranks[n]) for n in g.names]

    def after_commit(self, opt: Optimizer, g: _Group, i: int, st: dict) -> None:
        st["tail"] = g.tails[i]


class SensitivityStrategy(BudgetStrategy):
    """The data-aware budget: each group's directions ordered by their smoothed sensitivity
    scores (:func:`.functional.by_sensitivity`) before the allocation, which reads the scores."""

    scores = True

    def __init__(self, beta1: float, beta2: float) -> None:
        self.beta1, self.beta2 = beta1, beta2

    def reorder(self, g: _Group) -> None:

        prev = [st.get("sensitivity") for st in g.states]
        dt = g.planned.plan.s.dtype
        previous = None if prev[0] is None else tuple(_stack([p[j] for p in prev], dt) for j in (0, 1))
        cost = torch.tensor([m.out_features + m.in_features for m in g.layers], device=g.plan.s.device)
        g.planned, g.smoothed, g.scores = functional.by_sensitivity(g.planned, previous, cost,
                                                                    beta1=self.beta1, beta2=self.beta2)

    def after_commit(self, opt: Optimizer, g: _Group, i: int, st: dict) -> None:
        super().after_commit(opt, g, i, st)
        st["sensitivity"] = [t[i, :g.r1[i]].clone() for t in g.smoothed]


def strategy(settings: Settings) -> Strategy:
    """The step's strategy for these settings."""
    t = settings.truncation
    if settings.budgeted:
        return SensitivityStrategy(t.beta1, t.beta2) if t.data_aware else BudgetStrategy()
    return ToleranceStrategy(settings) if settings.adaptive else Strategy()
