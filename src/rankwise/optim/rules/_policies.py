r"""The integrator's choices as small policy objects (optax's transforms, diffrax's controllers).

An :class:`~rankwise.AugmentedBUG` optimizer takes one *truncation* policy and, optionally, one
*feedback* policy:

- :class:`Tolerance` (τ): every layer keeps the smallest rank whose discarded tail is at most
  τ‖S̄‖_F — a per-layer, relative rule; the ranks follow the spectra.
- :class:`Budget` (a compression target): the ranks are allocated model-wide so that the
  stored parameters equal a budget that falls from the model's size to the target
  (:func:`._budget.allocate_ranks`, :func:`._budget.budget_schedule`).
- :class:`SeedFeedback` (SDLRT as written: τ ← ωτ while a layer's rank is below its initial
  rank) and :class:`TwoSidedFeedback` (also τ ← τ/ω while it is above) adjust a
  :class:`Tolerance`'s τ per layer after each truncation.

The policies are frozen dataclasses: they hold settings, not state (the optimizer's
``param_groups`` / ``state`` hold that, so it is saved with ``state_dict``).
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from dataclasses import dataclass, fields
from typing import TYPE_CHECKING, ClassVar

from ..._checks import check_unit_interval

if TYPE_CHECKING:
    from torch import Tensor


def _real(name: str, value: object, *, finite: bool = True) -> float:
    """`value` as a float: a real number (Python, NumPy or a one-element real tensor), not a
    bool or a string; finite unless `finite` is False. Shared by every argument check of the
    optimizers."""
    bad = isinstance(value, bool | str | bytes) or (
        hasattr(value, "numel") and (value.numel() != 1 or value.is_complex()))  # type: ignore[union-attr]
    try:
        x = float(value)  # type: ignore[arg-type]
    except (TypeError, ValueError, RuntimeError):
        bad = True
    if bad:
        raise TypeError(f"`{name}` must be a real number; got {value!r} ({type(value).__name__})")
    if finite and not math.isfinite(x):
        raise ValueError(f"`{name}` must be finite; got {value!r}")
    return x


@dataclass(frozen=True)
class Tolerance:
    """Truncate every layer at the relative tolerance `tau` in [0, 1): the discarded singular
    values satisfy ‖σ_tail‖ ≤ τ‖σ‖ (DLRT's rule, per layer)."""

    tau: float
    data_aware: ClassVar[bool] = False  # ranks from the spectra alone

    def __post_init__(self) -> None:
        check_unit_interval(_real("tau", self.tau), "tau")


@dataclass(frozen=True, repr=False)
class Budget:
    """A global parameter budget for the low-rank layers, with ranks allocated model-wide.

    **Arguments** (give `target` or `params`):
    - `target`: the compression to reach, in (0, 1) (``rankwise.compression(model)["ratio"]``,
      e.g. 0.9 stores 10 % of the dense parameters, every parameter of the model counted).
    - `params`: instead, the parameters the low-rank layers may hold (U, S, V, and with
      `count_buffer` SDLRT's buffers at their largest, b = r), e.g. the trainable parameters
      of LoRA at rank r for adapters.
    - `ramp_steps`: the budget falls from what is stored when the optimizer is built to the
      end budget over this many augmentations, cubically (AdaLoRA's schedule without its
      warm-up and final phases: the run before and after the ramp plays their part), then
      stays there. 0: the end budget from the first step.
    - `allocation`: what a singular direction is worth per parameter it costs:
      ``"error-sqrt"`` (default), ``"error"``, ``"energy"``, ``"uniform"``
      (:mod:`rankwise.nn._budget`) or ``"sensitivity"`` (its smoothed importance to the
      loss, :mod:`rankwise.optim._sensitivity`, with smoothing factors `beta1`, `beta2`).
    - `floor`: every layer keeps at least this share of the rank a uniform allocation of the
      current budget would give it (0: no floor beyond the optimizer's `min_rank`): no layer
      becomes a one-dimensional bottleneck.
    - `freeze_after`: from this augmentation on the ranks stay as they are (an end phase at
      fixed ranks; must be >= `ramp_steps`); ``None``: they may move to the end.
    - `count_buffer`: count SDLRT's buffer in the budget (see `params`).
    """

    target: float | None = None
    ramp_steps: int = 200
    allocation: str = "error-sqrt"
    params: int | None = None
    floor: float = 0.0
    freeze_after: int | None = None
    count_buffer: bool = False
    beta1: float = 0.85
    beta2: float = 0.85

    def __post_init__(self) -> None:
        if (self.target is None) == (self.params is None):
            raise ValueError("give a Budget exactly one of `target` (a compression, e.g. 0.9) or `params` "
                             f"(a parameter count); got target={self.target!r}, params={self.params!r}")
        if self.target is not None and not 0 < _real("target", self.target) < 1:
            raise ValueError(f"`target` must be a compression in (0, 1), e.g. 0.9 for 10 % of the "
                             f"dense parameters; got {self.target!r}")
        if self.params is not None and (isinstance(self.params, bool) or not isinstance(self.params, int)
                                        or self.params < 1):
            raise ValueError(f"`params` must be an int >= 1 (a parameter count); got {self.params!r}")
        for name in ("ramp_steps",):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 0:
                raise ValueError(f"`{name}` must be an int >= 0; got {v!r}")
        if self.freeze_after is not None and (isinstance(self.freeze_after, bool)
                                              or not isinstance(self.freeze_after, int)
                                              or self.freeze_after < self.ramp_steps):
            raise ValueError(f"`freeze_after` must be None or an int >= ramp_steps ({self.ramp_steps}): "
                             f"the ranks can only freeze once the budget has reached its end; "
                             f"got {self.freeze_after!r}")
        if not 0 <= _real("floor", self.floor) <= 1:
            raise ValueError(f"`floor` must be in [0, 1]; got {self.floor!r}")
        for name in ("beta1", "beta2"):
            if not 0 <= _real(name, getattr(self, name)) < 1:
                raise ValueError(f"`{name}` must be in [0, 1); got {getattr(self, name)!r}")
        from ...nn._budget import TRAINING_RULES

        if self.allocation not in TRAINING_RULES:
            raise ValueError(f"`allocation` must be one of {TRAINING_RULES}; got {self.allocation!r}")

    def __repr__(self) -> str:  # fields at their defaults left out (the optimizer's state records it)
        shown = [f"{f.name}={getattr(self, f.name)!r}" for f in fields(self)
                 if f.name in ("target", "ramp_steps", "allocation") or getattr(self, f.name) != f.default]
        return f"Budget({', '.join(shown)})"

    def end_params(self, dense: float, other: float = 0.0) -> float:
        """Parameters the model may store at the end: (1 − target)·`dense`, a whole count when
        it is one up to roundoff; with `params`, `params` + `other` (the parameters outside the
        low-rank layers, which the budget does not cover)."""
        if self.params is not None:
            return float(self.params + other)
        end = (1 - self.target) * dense
        return float(round(end)) if abs(end - round(end)) <= 1e-9 * max(1.0, end) else end

    def params_at(self, augmentation: int, start: float, dense: float, other: float = 0.0) -> float:
        """Parameters the model may store at `augmentation` (0, 1, …), falling from `start`
        to :meth:`end_params`."""
        from ...nn._budget import budget_schedule

        end = self.end_params(dense, other)
        if self.ramp_steps == 0 or augmentation >= self.ramp_steps:
            return end
        return budget_schedule(augmentation, self.ramp_steps, start, end, warmup=0.0, final=0.0)

    def frozen(self, augmentation: int) -> bool:
        """Do the ranks stay as they are at this augmentation (`freeze_after`)?"""
        return self.freeze_after is not None and augmentation >= self.freeze_after

    def allocate(self, spectra: dict[str, Tensor], shapes: dict[str, tuple[int, int]], budget: float, *,
                 min_rank: int, max_ranks: dict[str, int], buffer: bool = False,
                 scores: dict[str, list[float]] | None = None) -> dict[str, int]:
        """This budget's ranks: `budget` parameters shared among the layers of `spectra` (each
        layer's singular values, in the order it keeps its directions; `shapes` (out, in)) by
        the `allocation` rule (:func:`._budget.allocate_ranks`; `scores` for
        ``"sensitivity"``), each layer at least `min_rank` and `floor` × its uniform share, at
        most its `max_ranks`."""
        from ...nn._budget import allocate_ranks

        floors: int | dict[str, int] = min_rank
        if self.floor > 0:  # a share of the rank a uniform allocation would give
            uniform = allocate_ranks(spectra, shapes, budget, min_rank=min_rank, max_ranks=max_ranks,
                                     rule="uniform", buffer=buffer)
            floors = {n: max(min_rank, math.ceil(self.floor * r)) for n, r in uniform.items()}
        return allocate_ranks(spectra, shapes, budget, min_rank=floors, max_ranks=max_ranks,
                              rule=self.allocation, scores=scores, buffer=buffer)

    @property
    def data_aware(self) -> bool:
        """Does the allocation read the loss's gradients (``"sensitivity"``), not only the
        spectra? Such a budget needs the per-layer path (its scores are smoothed per layer)."""
        return self.allocation == "sensitivity"


class Feedback(ABC):
    """Adjusts a layer's tolerance τ after each truncation (SDLRT). Subclass and implement
    :meth:`__call__` for a rule of your own."""

    tau_min: float = 0.0  # the optimizer checks 0 <= tau_min <= τ; a rule of your own may keep 0

    @abstractmethod
    def __call__(self, tau: float, rank: int, r_init: int, tau0: float) -> float:
        """The layer's next τ, given its τ now, its new `rank`, its rank when the optimizer
        was built (`r_init`) and the initial tolerance `tau0`."""

    def _check(self) -> None:
        if not 0 < _real("omega", self.omega) < 1:
            raise ValueError(f"`omega` must be in (0, 1); got {self.omega}")
        check_unit_interval(_real("tau_min", self.tau_min), "tau_min")


@dataclass(frozen=True)
class SeedFeedback(Feedback):
    """The paper's rule: τ ← max(ωτ, τ_min) whenever the rank is below the initial rank. It
    only ever lowers τ: a layer whose rank settles below its start drives τ down to τ_min and
    then grows back to (at least) its initial rank, so it does not converge to a compression."""

    omega: float = 0.8
    tau_min: float = 0.0

    def __post_init__(self) -> None:
        self._check()

    def __call__(self, tau: float, rank: int, r_init: int, tau0: float) -> float:
        return max(self.omega * tau, self.tau_min) if rank < r_init else tau


TAU_MAX = 0.5  # the two-sided rule never relaxes τ beyond max(initial τ, this)


@dataclass(frozen=True)
class TwoSidedFeedback(Feedback):
    """The seed's rule, plus τ ← min(τ/ω, max(τ0, τ_max)) whenever the rank is above the initial
    rank: τ stops moving once the rank sits at its start, so the rule converges (for an initial
    τ > 0: from τ = 0, τ/ω stays 0)."""

    omega: float = 0.8
    tau_min: float = 0.0
    tau_max: float = TAU_MAX

    def __post_init__(self) -> None:
        self._check()
        if not 0 < _real("tau_max", self.tau_max) < 1:
            raise ValueError(f"`tau_max` must be in (0, 1); got {self.tau_max}")

    def __call__(self, tau: float, rank: int, r_init: int, tau0: float) -> float:
        if rank < r_init:
            return max(self.omega * tau, self.tau_min)
        if rank > r_init:
            return min(tau / self.omega, max(tau0, self.tau_max))
        return tau
