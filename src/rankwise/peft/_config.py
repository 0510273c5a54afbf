"""AdapterConfig: what :func:`get_adapter_model` wraps and how the adapters are trained."""

from __future__ import annotations

import json
import re
from dataclasses import asdict, dataclass, fields
from typing import Any

from .._checks import check_unit_interval

METHODS = ("sdlrt", "dlrt")


@dataclass(frozen=True)
class AdapterConfig:
    """Rank-adaptive adapters on a model's ``nn.Linear`` layers (PEFT's conventions).

    **Arguments:**
    - `target_modules`: the Linear layers to adapt: a list of names (a module matches when its
      full name equals one, or ends with ``"." + name``, as in PEFT: ``["query", "value"]``) or
      one regular expression matched against the full name (``re.fullmatch``).
    - `r`: the adapters' initial rank (clamped to min(out, in) per layer); default 10.
    - `tau`, `omega`: the integrator's truncation tolerance and SDLRT's feedback factor.
    - `method`: ``"sdlrt"`` (buffer + τ feedback) or ``"dlrt"``.
    - `max_rank`: cap for rank growth (default: none beyond min(out, in)). Set one: from the
      zero start a small relative τ keeps nearly every direction of the first flat spectra,
      so the ranks double at each step (docs/peft.md); ``rankwise peft`` uses 2·r.
    - `alpha`: the adapter's output scale: y = W0 x + alpha · U S Vᵀ x (a fixed number, not
      LoRA's alpha / r: the rank changes, the scale must not).
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
            if not names or not all(isinstance(n, str) and n for n in names):
                raise ValueError(f"`target_modules` must name at least one module; got {tm!r}")
            object.__setattr__(self, "target_modules", names)
        if self.modules_to_save is not None:
            object.__setattr__(self, "modules_to_save", tuple(self.modules_to_save))
        if isinstance(self.r, bool) or not isinstance(self.r, int) or self.r < 1:
            raise ValueError(f"`r` must be an int >= 1; got {self.r!r}")
        if self.max_rank is not None and (not isinstance(self.max_rank, int) or self.max_rank < self.r):
            raise ValueError(f"`max_rank` must be None or an int >= r ({self.r}); got {self.max_rank!r}")
        check_unit_interval(self.tau, "tau")
        if not 0 < self.omega < 1:
            raise ValueError(f"`omega` must be in (0, 1); got {self.omega}")
        if self.method not in METHODS:
            raise ValueError(f"`method` must be one of {METHODS}; got {self.method!r}")
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


def _matches(patterns: tuple[str, ...] | str, name: str) -> bool:
    if isinstance(patterns, str):
        return re.fullmatch(patterns, name) is not None
    return any(name == p or name.endswith("." + p) for p in patterns)
