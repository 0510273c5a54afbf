"""Argument checks shared by the library and the torch-free configs (one wording everywhere)."""

from __future__ import annotations


def check_unit_interval(value, name: str = "tau") -> None:
    """Raise ``ValueError`` unless `value` is in [0, 1) (a relative tolerance: τ, τ_min, …)."""
    if not 0 <= value < 1:  # (also refuses NaN)
        raise ValueError(f"`{name}` must be in [0, 1); got {value}")


def check_choice(value, choices, name: str) -> None:
    """Raise ``ValueError`` unless `value` is one of `choices`, naming them all."""
    if value not in choices:
        listed = " or ".join(map(repr, choices)) if len(choices) == 2 else \
            "one of " + ", ".join(map(repr, choices))
        raise ValueError(f"`{name}` must be {listed}; got {value!r}")


def check_rank(value, name: str = "rank") -> None:
    """Raise ``ValueError`` unless `value` is an int >= 1 (a rank or rank cap; ``True``, ``1.5``
    and numpy floats refused rather than truncated or read as 1)."""
    import numbers

    if not (isinstance(value, numbers.Integral) and not isinstance(value, bool) and value >= 1):
        raise ValueError(f"`{name}` must be an int >= 1; got {value!r}")


def code_geometry_problem(n, t) -> str | None:
    """Why (n, t) is not a geometry of the 2-D code (``None`` when it is one): integers with
    1 <= t and 3t < n <= 255, the hint saying which bound to move."""
    if not (is_int(n) and is_int(t)):
        return f"n and t must be integers; got n={n!r}, t={t!r}"
    if t >= 1 and 3 * t < n <= 255:
        return None
    hint = ("t must be at least 1" if t < 1 else
            "n must be at most 255; with n=255, t can be at most 84" if n > 255 else
            f"with t={t}, n must be at least {3 * t + 1}; or lower t to at most {max((n - 1) // 3, 0)}"
            if n >= 4 else "n must be at least 4 (t = 1)")
    return f"need 1 <= t and 3t < n <= 255; got n={n}, t={t} ({hint})"


_COUNTS = ("epochs", "steps", "max_steps", "batch_size")


def check_training(**settings) -> None:
    """Check the settings every training run has, with one wording for all run configs
    (:class:`rankwise.train.TrainConfig`, the sweep's, the ODE and PEFT studies' specs):
    ``epochs``, ``steps``, ``batch_size`` ints ≥ 1; ``lr`` a finite number > 0; ``momentum``
    in [0, 1); ``seed`` an int. Raises ``ValueError`` (``TypeError`` for a non-int seed)."""
    import math

    for name, v in settings.items():
        if name in _COUNTS:
            if not is_int(v) or v < 1:
                raise ValueError(f"`{name}` must be an int >= 1; got {v!r}")
        elif name == "lr":
            if not (isinstance(v, int | float) and not isinstance(v, bool) and math.isfinite(v) and v > 0):
                raise ValueError(f"`lr` must be a finite number > 0; got {v!r}")
        elif name == "momentum":
            if not (isinstance(v, int | float) and 0 <= v < 1):
                raise ValueError(f"`momentum` must be in [0, 1); got {v!r}")
        elif name == "seed":
            if not is_int(v):
                raise TypeError(f"`seed` must be an int; got {type(v).__name__}")
            if not 0 <= v < 2**32:  # what numpy's and scikit-learn's generators accept
                raise ValueError(f"`seed` must be in [0, 2**32); got {v}")
        else:
            raise TypeError(f"check_training: unknown setting {name!r}")


def is_int(x: object) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)
