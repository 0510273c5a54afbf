"""to_low_rank: replace a model's nn.Linear / nn.Conv2d layers by low-rank ones."""

from __future__ import annotations

import re
import warnings
from collections.abc import Iterable

from torch import nn

from ._conv import LowRankConv2d
from ._linear import LowRankLinear

Pattern = str | Iterable[str] | None


def _matches(name: str, pattern: Pattern) -> bool:
    """A str is a regex matched against the full module name; a list holds names or name
    suffixes (``"fc1"`` matches ``"encoder.fc1"``), as HF PEFT's ``target_modules``."""
    if isinstance(pattern, str):
        return re.fullmatch(pattern, name) is not None
    return any(name == p or name.endswith("." + p) for p in pattern)


def to_low_rank(model: nn.Module, *, rank: int | None = None, tau: float | None = None,
                include: Pattern = None, exclude: Pattern = None,
                max_rank: int | None = None) -> nn.Module:
    """Replace matching ``nn.Linear`` / ``nn.Conv2d`` modules by their truncated SVDs, in place.

    **Arguments:**
    - `model`: any module; it is modified in place and returned.
    - `rank`: fixed initial rank, clamped to min(out, in) per layer.
    - `tau`: or the smallest rank with discarded tail ≤ tau·‖W‖_F (both: the smaller rank).
    - `include`, `exclude`: module-name filters (regex string, or a list of names/suffixes).
    - `max_rank`: cap for later rank growth (default: min(out, in) per layer).

    A pretrained model keeps its function up to the truncation error. Conv layers that
    LowRankConv2d cannot express (groups ≠ 1, non-zero padding modes, 'same' padding with an
    even kernel) are left dense, with a warning.
    """
    if rank is None and tau is None:
        raise ValueError("to_low_rank needs `rank` or `tau` (or both)")
    if rank is not None and rank < 1:
        raise ValueError(f"`rank` must be >= 1; got {rank}")
    targets = []
    for name, mod in model.named_modules():
        if type(mod) not in (nn.Linear, nn.Conv2d):
            continue
        if include is not None and not _matches(name, include):
            continue
        if exclude is not None and _matches(name, exclude):
            continue
        targets.append((name, mod))
    for name, mod in targets:
        if isinstance(mod, nn.Linear):
            new = LowRankLinear.from_dense(mod, rank=rank, tau=tau, max_rank=max_rank)
        else:
            try:
                new = LowRankConv2d.from_dense(mod, rank=rank, tau=tau, max_rank=max_rank)
            except ValueError as e:  # groups, padding modes or 'same' padding we cannot express
                warnings.warn(f"to_low_rank: leaving {name!r} dense: {e}", stacklevel=2)
                continue
        new.train(mod.training)
        _set_submodule(model, name, new)
    return model


def _set_submodule(model: nn.Module, name: str, new: nn.Module) -> None:
    if name == "":
        raise ValueError("to_low_rank cannot replace the root module itself; wrap it first")
    parent_name, _, child = name.rpartition(".")
    parent = model.get_submodule(parent_name) if parent_name else model
    setattr(parent, child, new)
