"""AdapterConfig: what :func:`get_adapter_model` wraps and how the adapters are trained."""

from __future__ import annotations

import json
import math
import re
from dataclasses import asdict, dataclass, fields
from typing import Any

from .._checks import check_unit_interval

METHODS = ("sdlrt", "dlrt")
_LORA_BUDGET = re.compile(r"lora:([0-9]+)")


@dataclass(frozen=True)
class AdapterConfig:
    """Rank-adaptive adapters on a model's ``nn.Linear`` layers (PEFT's conventions).

    **Arguments:**
    - `target_modules`: the Linear layers to adapt: a list of names (a module matches when its
      full name equals one, or ends with ``"." + name``, as in PEFT: ``["query", "value"]``) or
      one regular expression matched against the full name (``re.fullmatch``).
    - `r`: the adapters' initial rank (clamped to min(out, in) per layer); default 10. Not
      used with a `budget`, which sets the initial rank.
    - `tau`, `omega`: the integrator's truncation tolerance and SDLRT's feedback factor.
    - `method`: ``"sdlrt"`` (buffer + τ feedback) or ``"dlrt"``.
    - `max_rank`: cap for rank growth (default: none beyond min(out, in)). Set one: from the
      zero start a small relative τ keeps nearly every direction of the first flat spectra,
      so the ranks double at each step (docs/peft.md); ``rankwise peft`` uses 2·r.
    - `alpha`: the adapter's output scale: y = W0 x + alpha · U S Vᵀ x (a fixed number, not
      LoRA's alpha / r: the rank changes, the scale must not). PEFT's LoRA computes
      y = W0 x + (lora_alpha / r) · B A x, so LoRA at r = 10 with lora_alpha = 16 scales by 1.6,
      which is `alpha` = 1.6 here; ``lora_alpha = r`` is `alpha` = 1.0, the default.
    - `budget`: ``None`` (default: the ranks follow τ, capped by `max_rank`), an int, or
      ``"lora:R"``: the trainable parameters the adapters may hold, all adapted modules
      together, at every step. An int is a parameter count; ``"lora:R"`` is what PEFT's LoRA
      at rank R trains on the same modules, Σ R · (in + out) over the adapted Linear layers.
      The adapters start at the largest rank, the same for every layer (clamped to
      min(out, in)), whose cost fits, and :func:`adapter_optimizer` holds the budget while it
      moves rank between the modules (:class:`rankwise.Budget` with ``params``, no ramp). A
      layer at rank r costs r (in + out) + r² (U, V, S); SDLRT's compensation buffer is
      counted too, at its largest (another r (in + out)), so SDLRT gets lower ranks than DLRT
      on the same budget. `tau` is then not used.
    - `dropout`: dropout on the adapter's input.
    - `modules_to_save`: modules trained in full besides the adapters (e.g. ``["classifier"]``),
      matched by name as `target_modules` lists are.

    ``to_json()`` / ``from_json()`` round-trip it.
    """

    target_modules: tuple[str, ...] | str
    r: int = 10
    tau: float = 0.02
    omega: float = 0.8
    method: str = "sdlrt"
    max_rank: int | None = None
    alpha: float = 1.0
    dropout: float = 0.0
    modules_to_save: tuple[str, ...] | None = None
    budget: int | str | None = None

    def __post_init__(self) -> None:
        tm = self.target_modules
        if isinstance(tm, str):
            try:
                re.compile(tm)
            except re.error as e:
                raise ValueError(f"`target_modules` {tm!r} is not a valid regular expression: {e}") from None
        else:
            try:
                names = tuple(tm)
            except TypeError:
                raise TypeError("`target_modules` must be a list of module names or a regex string; "
                                f"got {tm!r}") from None
            if not names:
                raise ValueError(f"`target_modules` must name at least one module; got {tm!r}")
            if bad := [n for n in names if not (isinstance(n, str) and n)]:
                raise TypeError(f"`target_modules` entries must be non-empty module names (str); got {bad!r} "
                                f"in {tm!r}")
            object.__setattr__(self, "target_modules", names)
        if self.modules_to_save is not None:
            object.__setattr__(self, "modules_to_save", tuple(self.modules_to_save))
        if isinstance(self.r, bool) or not isinstance(self.r, int) or self.r < 1:
            raise ValueError(f"`r` must be an int >= 1; got {self.r!r}")
        least, what = (1, "1") if self.budget is not None else (self.r, f"r ({self.r})")  # a budget sets r
        cap = self.max_rank
        if cap is not None and (isinstance(cap, bool) or not isinstance(cap, int) or cap < least):
            raise ValueError(f"`max_rank` must be None or an int >= {what}; got {cap!r}")
        _check_budget(self.budget)
        check_unit_interval(self.tau, "tau")
        if not 0 < self.omega < 1:
            raise ValueError(f"`omega` must be in (0, 1); got {self.omega}")
        if self.method not in METHODS:
            raise ValueError(f"`method` must be one of {METHODS}; got {self.method!r}")
        if isinstance(self.alpha, bool) or not isinstance(self.alpha, int | float) \
                or not (math.isfinite(self.alpha) and self.alpha > 0):
            raise ValueError(f"`alpha` (the adapter's output scale) must be a finite number > 0; "
                             f"got {self.alpha!r}")
        if not 0 <= self.dropout < 1:
            raise ValueError(f"`dropout` must be in [0, 1); got {self.dropout}")

    def matches(self, name: str) -> bool:
        """Is the module called `name` a target?"""
        return _matches(self.target_modules, name)

    def saves(self, name: str) -> bool:
        """Is the module called `name` one of `modules_to_save`?"""
        return self.modules_to_save is not None and _matches(self.modules_to_save, name)

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        for key in ("target_modules", "modules_to_save"):
            if isinstance(d[key], tuple):
                d[key] = list(d[key])
        return d

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> AdapterConfig:
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(d) - known)
        if unknown:
            raise ValueError(f"unknown AdapterConfig fields {unknown}; known: {sorted(known)}")
        return cls(**d)

    @classmethod
    def from_json(cls, text: str) -> AdapterConfig:
        return cls.from_dict(json.loads(text))


def _check_budget(budget: int | str | None) -> None:
    if budget is None:
        return
    if isinstance(budget, str):
        m = _LORA_BUDGET.fullmatch(budget.strip())
        if m is None or int(m.group(1)) < 1:
            raise ValueError(f"`budget` as a string must be 'lora:R' with R an int >= 1 (the trainable "
                             f"parameters of LoRA at rank R), e.g. 'lora:10'; got {budget!r}")
        return
    if isinstance(budget, bool) or not isinstance(budget, int) or budget < 1:
        raise ValueError(f"`budget` must be None, a parameter count (an int >= 1) or 'lora:R'; "
                         f"got {budget!r}")


def lora_rank_of(budget: int | str | None) -> int | None:
    """R of a ``"lora:R"`` budget; ``None`` for any other."""
    if isinstance(budget, str):
        m = _LORA_BUDGET.fullmatch(budget.strip())
        return None if m is None else int(m.group(1))
    return None


def _matches(patterns: tuple[str, ...] | str, name: str) -> bool:
    if isinstance(patterns, str):
        return re.fullmatch(patterns, name) is not None
    return any(name == p or name.endswith("." + p) for p in patterns)
