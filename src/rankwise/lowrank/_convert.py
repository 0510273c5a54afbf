"""to_low_rank: replace a model's nn.Linear / nn.Conv2d layers by low-rank ones."""

from __future__ import annotations

import re
import warnings
from collections.abc import Iterable, Mapping

import torch
from torch import nn

from .._checks import check_rank
from ..linalg import work_dtype
from ._base import AbstractLowRankLayer
from ._conv import LowRankConv2d
from ._linear import LowRankLinear

Pattern = str | Iterable[str] | None


def _matches(name: str, pattern: Pattern) -> bool:
    """A str is a regex matched against the full module name; a list holds names or name
    suffixes (``"fc1"`` matches ``"encoder.fc1"``), as HF PEFT's ``target_modules``."""
    if isinstance(pattern, str):
        return re.fullmatch(pattern, name) is not None
    return any(name == p or name.endswith("." + p) for p in pattern)


def to_low_rank(model: nn.Module, *, rank: int | Mapping[str, int] | None = None, tau: float | None = None,
                include: Pattern = None, exclude: Pattern = None,
                max_rank: int | None = None, target: float | None = None,
                allocation: str = "error-sqrt") -> nn.Module:
    """Replace matching ``nn.Linear`` / ``nn.Conv2d`` modules by their truncated SVDs, in place.

    **Arguments:**
    - `model`: any module; it is modified in place and returned.
    - `rank`: fixed initial rank, clamped to min(out, in) per layer; or a mapping
      ``{module name: rank}`` that names exactly the layers to convert, each at its own rank
      (given alone: no `tau`, `target`, `include` or `exclude`).
    - `tau`: or the smallest rank with discarded tail ≤ tau·‖W‖_F (both: the smaller rank).
    - `include`, `exclude`: module-name filters (regex string, or a list of names/suffixes).
    - `max_rank`: cap for later rank growth (default: min(out, in) per layer).
    - `target`: instead of `rank` / `tau`, the compression to reach
      (``rankwise.compression(model)["ratio"]`` after the call): the ranks are allocated
      model-wide from the layers' singular values, as DLRT's budget does
      (``rankwise.lowrank._budget.allocate_ranks``), at least rank 1 per layer;
    - `allocation`: with a `target`, how (``"error-sqrt"``: directions by the relative error they
      remove per √(parameters); ``"error"``, ``"energy"``; ``"uniform"``: one rank for all).

    A pretrained model keeps its function up to the truncation error. Conv layers that
    LowRankConv2d cannot express (groups ≠ 1, non-zero padding modes, 'same' padding with an
    even kernel) are left dense, with a warning. Only exact ``nn.Linear`` / ``nn.Conv2d``
    modules are converted (not their subclasses).

    Layers that are already low-rank (:class:`LowRankLinear`, :class:`LowRankConv2d`) are left
    as they are: on a mixed model only the remaining dense layers are converted. If nothing
    would be converted (every matching layer is already low-rank, no ``nn.Linear`` /
    ``nn.Conv2d`` matches `include` / `exclude`, or none can be expressed) a ``ValueError`` is
    raised and the model is not changed; ranks of low-rank layers change through the
    optimizer's truncation (``tau``, ``max_rank`` of DLRT/SDLRT), not through this function.
    """
    if target is not None:
        if rank is not None or tau is not None:
            raise ValueError("give `target` alone, or `rank` / `tau`: the target sets every rank")
        if not (isinstance(target, int | float) and 0 < target < 1):
            raise ValueError(f"`target` must be a compression in (0, 1); got {target!r}")
    elif rank is None and tau is None:
        raise ValueError("to_low_rank needs `rank` or `tau` (or both), or a `target` compression")
    from ._budget import RULES

    if allocation not in RULES:
        raise ValueError(f"`allocation` must be one of {RULES}; got {allocation!r}")
    if target is None and allocation != RULES[0]:
        raise ValueError(f"`allocation`={allocation!r} needs a `target` (it decides how the target's "
                         "parameters are shared out)")
    per_layer: dict[str, int] = {}
    if isinstance(rank, Mapping):
        if tau is not None or target is not None or include is not None or exclude is not None:
            raise ValueError("a `rank` mapping names every layer to convert and its rank: give it without "
                             "`tau`, `target`, `include` or `exclude`")
        modules = dict(model.named_modules())
        unknown = [n for n in rank if n not in modules]
        if unknown or not rank:
            raise ValueError(f"`rank` maps names that are not modules of the model: {unknown}" if unknown
                             else "`rank` is an empty mapping: it names no layer to convert")
        for name, r in rank.items():
            check_rank(r, f"rank[{name!r}]")
        per_layer, rank = dict(rank), None
    for name, value in (("rank", rank), ("max_rank", max_rank)):
        if value is not None:
            check_rank(value, name)
    # a one-shot iterator (e.g. a generator) would be used up by the first module name
    include = include if include is None or isinstance(include, str) else list(include)
    exclude = exclude if exclude is None or isinstance(exclude, str) else list(exclude)

    names = [n for n, _ in model.named_modules()]
    for option, entries in (("include", include), ("exclude", exclude)):
        unknown = [e for e in entries if not any(_matches(n, [e]) for n in names)] \
            if isinstance(entries, list) else []
        # (an include list that matches nothing at all gets the message below, which lists the layers)
        if unknown and (option == "exclude" or len(unknown) < len(entries)):
            layers = [n for n, m in model.named_modules() if isinstance(m, nn.Linear | nn.Conv2d)]
            raise ValueError(f"`{option}` names no module of the model: {unknown} (a list entry is a module "
                             f"name or a suffix of one; the model's layers: {', '.join(map(repr, layers))})")

    def selected(name: str) -> bool:
        if per_layer:
            return name in per_layer
        return ((include is None or _matches(name, include))
                and (exclude is None or not _matches(name, exclude)))

    targets, low_rank, subclassed = [], [], []
    for name, mod in model.named_modules():
        if not selected(name):
            continue
        if type(mod) in (nn.Linear, nn.Conv2d):
            targets.append((name, mod))
        elif isinstance(mod, AbstractLowRankLayer):
            low_rank.append((name, mod))
        elif isinstance(mod, nn.Linear | nn.Conv2d):
            subclassed.append((name, mod))
    if target is not None:  # convs LowRankConv2d cannot express stay dense: not in the budget
        convertible = [(n, m) for n, m in targets
                       if not isinstance(m, nn.Conv2d) or LowRankConv2d.unsupported(m) is None]
        ranks = _target_ranks(model, convertible, target, allocation) if convertible else {}
    else:
        ranks = per_layer  # (empty unless `rank` was a mapping)
    converted, left_dense = 0, []
    for name, mod in targets:
        r = ranks.get(name, rank)
        if isinstance(mod, nn.Linear):
            new = LowRankLinear.from_dense(mod, rank=r, tau=tau, max_rank=max_rank)
        else:
            try:
                new = LowRankConv2d.from_dense(mod, rank=r, tau=tau, max_rank=max_rank)
            except ValueError as e:  # groups, padding modes or 'same' padding we cannot express
                left_dense.append((name, e))
                continue
        new.train(mod.training)
        _set_submodule(model, name, new)
        converted += 1
    if not converted:
        raise ValueError(_nothing_converted(model, include, exclude, low_rank, subclassed,
                                            left_dense))
    for name, e in left_dense:
        warnings.warn(f"to_low_rank: leaving {name!r} dense: {e}", stacklevel=2)
    return model


@torch.no_grad()
def _target_ranks(model: nn.Module, targets: list, target: float, allocation: str) -> dict[str, int]:
    """Ranks of the dense `targets` that bring the model's compression to `target` (``max_rank``
    of :func:`to_low_rank` caps later growth, not these ranks)."""
    from ._budget import allocate_ranks
    from ._metrics import compression

    c = compression(model)
    weights = {name: mod.weight.reshape(mod.weight.shape[0], -1) for name, mod in targets}
    fixed = c["stored_params"] - sum(w.numel() for w in weights.values())  # biases, other layers
    budget = (1 - target) * c["dense_params"] - fixed
    if budget <= 0:
        raise ValueError(f"`target`={target} cannot be reached: the parameters that stay as they are "
                         f"(biases, other layers) alone are {fixed:,} of {c['dense_params']:,}")
    spectra = {n: torch.linalg.svdvals(w.detach().to(work_dtype(w.dtype))) for n, w in weights.items()}
    shapes = {n: tuple(w.shape) for n, w in weights.items()}
    return allocate_ranks(spectra, shapes, budget, min_rank=1, rule=allocation)


def _nothing_converted(model: nn.Module, include: Pattern, exclude: Pattern, low_rank: list,
                       subclassed: list, left_dense: list) -> str:
    """The error message of a call of :func:`to_low_rank` that would convert no layer."""
    filters = ", ".join(f"{k}={v!r}" for k, v in (("include", include), ("exclude", exclude))
                        if v is not None)
    where = f" matching {filters}" if filters else ""
    msg = "to_low_rank converted nothing"
    names = ", ".join(f"{_show(n)} ({type(m).__name__}, rank {m.rank})" for n, m in low_rank)
    if left_dense:
        already = f"; already low-rank: {names}" if names else ""
        return (f"{msg}: every nn.Linear / nn.Conv2d{where} is a convolution LowRankConv2d "
                f"cannot express ({'; '.join(f'{_show(n)}: {e}' for n, e in left_dense)})"
                f"{already}; the model was not changed")
    if low_rank:
        return (f"{msg}: the layers{where} are already low-rank: {names}. to_low_rank only "
                "converts nn.Linear / nn.Conv2d; to start from another rank, build the dense "
                "model again and convert that (a trained model: copy its weights into a fresh "
                "dense model via dense_weight()); during training ranks change through the "
                "optimizer's truncation (`tau`, `max_rank` of DLRT/SDLRT)")
    dense = [n for n, m in model.named_modules() if type(m) in (nn.Linear, nn.Conv2d)]
    if filters and dense:
        shown = ", ".join(_show(n) for n in dense[:10]) + (", ..." if len(dense) > 10 else "")
        hint = (f"; its nn.Linear / nn.Conv2d modules are: {shown} (a str filter is a regex "
                "matched against the full name, a list holds names or name suffixes)")
    else:
        hint = "; the model has no nn.Linear / nn.Conv2d module"
    if subclassed:
        hint += ("; subclasses of nn.Linear / nn.Conv2d are not converted: "
                 + ", ".join(f"{_show(n)} ({type(m).__name__})" for n, m in subclassed[:10]))
    return f"{msg}: no nn.Linear / nn.Conv2d{where} in the model{hint}"


def _show(name: str) -> str:
    return repr(name) if name else "<root module>"


def _set_submodule(model: nn.Module, name: str, new: nn.Module) -> None:
    if name == "":
        raise ValueError("to_low_rank cannot replace the root module itself; wrap it first")
    parent_name, _, child = name.rpartition(".")
    parent = model.get_submodule(parent_name) if parent_name else model
    setattr(parent, child, new)
