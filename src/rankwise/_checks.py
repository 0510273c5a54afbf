"""Argument checks shared by the library and the torch-free configs (one wording everywhere)."""

from __future__ import annotations


def check_unit_interval(value, name: str = "tau") -> None:
    """Raise ``ValueError`` unless `value` is in [0, 1) (a relative tolerance: τ, τ_min, …)."""
    if not 0 <= value < 1:  # (also refuses NaN)
        raise ValueError(f"`{name}` must be in [0, 1); got {value}")
