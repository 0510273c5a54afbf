"""Small formatting helper shared by the experiment reports."""

from __future__ import annotations

import math
import statistics


def mean_sd(vals: list[float]) -> tuple[float, float]:
    """(mean, sample standard deviation); the deviation is 0 for one value."""
    return statistics.mean(vals), statistics.stdev(vals) if len(vals) > 1 else 0.0


def mean_std(vals: list[float], fmt: str) -> str:
    """``"mean ± std"`` with ``fmt`` (e.g. ``"{:.3f}"``) for each; just the mean for one value;
    ``"—"`` where a value is missing (``None``) or not finite (a metric the run does not have,
    e.g. the GRU's audit, or d_t without the dense shadow)."""
    if not all(v is not None and math.isfinite(v) for v in vals):
        return "—"
    m = statistics.mean(vals)
    return fmt.format(m) + (f" ± {fmt.format(statistics.stdev(vals))}" if len(vals) > 1 else "")
