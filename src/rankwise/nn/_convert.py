"""to_low_rank: replace a model's nn.Linear / nn.Conv2d / nn.MultiheadAttention layers (and
Hugging Face's Conv1D) by low-rank ones."""

from __future__ import annotations

import re
import warnings
from collections import defaultdict
from collections.abc import Iterable, Mapping

import torch
from torch import nn

from .._checks import check_rank
from ..linalg import work_dtype
from ._attention import PROJECTIONS, LowRankMultiheadAttention, dense_projections
from ._attention import unsupported as attention_unsupported
from ._base import AbstractLowRankLayer, check_model, fsdp_classes
from ._budget import RULES, allocate_ranks
from ._conv import LowRankConv2d
from ._hf import LowRankConv1D, is_hf_conv1d
from ._linear import LowRankLinear
from ._metrics import compression

Pattern = str | Iterable[str] | None
LowRank = (AbstractLowRankLayer, LowRankMultiheadAttention)


def _matches(name: str, pattern: Pattern) -> bool:
    """A str is a regex matched against the full module name; a list holds names or name
    suffixes (``"fc1"`` matches ``"encoder.fc1"``), as HF PEFT's ``target_modules``."""
    if isinstance(pattern, str):
        return re.fullmatch(pattern, name) is not None
    return any(name == p or name.endswith("." + p) for p in pattern)


def _kind(mod: nn.Module) -> str | None:
    """Which conversion `mod` gets: exact torch / HF classes only, never subclasses."""
    kinds = {nn.Linear: "linear", nn.Conv2d: "conv", nn.MultiheadAttention: "attention"}
    if type(mod) in kinds:
        return kinds[type(mod)]
    return "conv1d" if is_hf_conv1d(mod) else None


def to_low_rank(model: nn.Module, *, rank: int | Mapping[str, int] | None = None, tau: float | None = None,
                include: Pattern = None, exclude: Pattern = None,
                max_rank: int | None = None, target: float | None = None,
                allocation: str = "error-sqrt", capacity: int | str | None = None) -> nn.Module:
    """Replace matching dense layers by their truncated SVDs, in place.

    Converted (exact classes, not their subclasses): ``nn.Linear`` → :class:`LowRankLinear`,
    ``nn.Conv2d`` → :class:`LowRankConv2d`, ``nn.MultiheadAttention`` →
    :class:`LowRankMultiheadAttention` (its q, k, v and output projections, each a
    LowRankLinear), Hugging Face's ``transformers.pytorch_utils.Conv1D`` (GPT-2) →
    :class:`LowRankConv1D` (transformers is imported by none of this).

    **Arguments:**
    - `model`: any module; it is modified in place and returned.
    - `rank`: fixed initial rank, clamped to min(out, in) per layer; or a mapping
      ``{module name: rank}`` that names exactly the layers to convert, each at its own rank
      (given alone: no `tau`, `target`, `include` or `exclude`). An attention module is named
      whole (one rank for its four projections) or per projection
      (``"enc.self_attn.q_proj"``, ``.k_proj``, ``.v_proj``, ``.out_proj``: all four).
    - `tau`: or the smallest rank with discarded tail ≤ tau·‖W‖_F (both: the smaller rank).
    - `include`, `exclude`: module-name filters (regex string, or a list of names/suffixes).
    - `max_rank`: cap for later rank growth (default: min(out, in) per layer).
    - `target`: instead of `rank` / `tau`, the compression to reach
      (``rankwise.compression(model)["ratio"]`` after the call): the ranks are allocated
      model-wide from the layers' singular values, as DLRT's budget does
      (``rankwise.nn._budget.allocate_ranks``), at least rank 1 per layer;
    - `allocation`: with a `target`, how (``"error-sqrt"``: directions by the relative error they
      remove per √(parameters); ``"error"``, ``"energy"``; ``"uniform"``: one rank for all).
    - `capacity`: store each converted layer's factors at a fixed capacity R, so that parameter
      shapes and storage never change while the rank moves below R (``set_capacity``; what DDP,
      ``torch.distributed.checkpoint`` resharding and ``torch.compile`` need): an int (R =
      min(capacity, out, in) per layer, at least its rank), or ``"auto"``: twice each layer's
      initial rank, capped at `max_rank` and min(out, in). Default ``None``: factors at the
      live rank, their shapes change at every truncation.

    A pretrained model keeps its function up to the truncation error. Layers with no low-rank
    equivalent are left dense, with one warning each: convolutions LowRankConv2d cannot express
    (groups ≠ 1, non-zero padding modes, 'same' padding with an even kernel) and attention with
    ``add_bias_kv`` / ``add_zero_attn``. A layer whose weight is tied to (is the same Parameter
    as) another module's -- an ``lm_head`` tied to the input embedding -- is left dense too, so
    the tie holds, with one warning naming all of them (naming one in a `rank` mapping raises).
    A module registered under several names is replaced under all of them by one low-rank layer
    (it is selected if one of its names passes `include` and none matches `exclude`).

    On a model built on the meta device the layers are built on meta at the given `rank`,
    without an SVD (load real weights afterwards); `tau` and `target` need the weights' values
    and raise ``ValueError`` there.

    Layers that are already low-rank are left as they are: on a mixed model only the remaining
    dense layers are converted. If nothing would be converted (every matching layer is already
    low-rank, tied, or inexpressible, or none matches `include` / `exclude`) a ``ValueError`` is
    raised and the model is not changed; ranks of low-rank layers change through the
    optimizer's truncation (``tau``, ``max_rank`` of DLRT/SDLRT), not through this function.
    ``TypeError`` if `model` is not an ``nn.Module`` (e.g. ``model.parameters()``).
    """
    check_model(model, "to_low_rank")
    if target is not None:
        if rank is not None or tau is not None:
            raise ValueError("give `target` alone, or `rank` / `tau`: the target sets every rank")
        if not (isinstance(target, int | float) and 0 < target < 1):
            raise ValueError(f"`target` must be a compression in (0, 1); got {target!r}")
    elif rank is None and tau is None:
        raise ValueError("to_low_rank needs `rank` or `tau` (or both), or a `target` compression")

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
        per_layer, rank = _check_rank_mapping(model, rank), None
    for name, value in (("rank", rank), ("max_rank", max_rank)):
        if value is not None:
            check_rank(value, name)
    whole = isinstance(capacity, int) and not isinstance(capacity, bool) and capacity >= 1
    if not (capacity is None or capacity == "auto" or whole):
        raise ValueError(f"`capacity` must be an int >= 1 or 'auto'; got {capacity!r}")
    # a one-shot iterator (e.g. a generator) would be used up by the first module name
    include = include if include is None or isinstance(include, str) else list(include)
    exclude = exclude if exclude is None or isinstance(exclude, str) else list(exclude)
    _check_filters(model, include, exclude)

    def selected(names: list[str]) -> bool:
        if per_layer:
            return any(n in per_layer or any(f"{n}.{p}" in per_layer for p in PROJECTIONS) for n in names)
        return (any(include is None or _matches(n, include) for n in names)
                and not any(exclude is not None and _matches(n, exclude) for n in names))

    _check_unsharded(model)
    names_of = _names(model)
    targets, low_rank, subclassed = _classify(model, names_of, selected, per_layer)
    tied = _tied(model, targets)
    if per_layer and tied:
        raise ValueError(f"`rank` names layers whose weight is tied to another module's: {_tied_text(tied)}; "
                         "converting them would untie the weights: leave them out")
    targets = [(n, m) for n, m in targets if n not in tied]
    others = _not_convertible(model, targets, subclassed)  # parametrised layers, subclasses: left dense
    targets = [(n, m) for n, m in targets if n not in others]
    _refuse_named(model, per_layer, include, {**others, **{n: _unsupported(m) for n, m in targets
                                                          if _unsupported(m) is not None}})
    expressible = [(n, m) for n, m in targets if _unsupported(m) is None]
    _check_meta(expressible, tau, target)
    _check_tensor_hooks(expressible)
    if target is not None:  # layers with no low-rank form stay dense: not in the budget
        ranks = _target_ranks(model, expressible, target, allocation) if expressible else {}
    else:
        ranks = _expand_attention(per_layer, targets) if per_layer else {}
    left_dense = [(n, _unsupported(m)) for n, m in targets if _unsupported(m) is not None]
    left_dense += list(others.items())
    if not expressible:
        raise ValueError(_nothing_converted(model, include, exclude, low_rank, subclassed, left_dense, tied))
    for name, mod in expressible:
        with own_rng(mod):
            new = _low_rank(mod, _rank_of(name, mod, ranks, rank), tau, max_rank)
        if capacity is not None:
            _fix_capacity(new, capacity, max_rank)
        carry_over(mod, new)
        for alias in names_of[id(mod)]:
            set_submodule(model, alias, new.train(mod.training))
    if tied:
        warnings.warn(f"to_low_rank: leaving layers dense whose weight is tied to another module's (so the "
                      f"tie holds; converting would untie it): {_tied_text(tied)}", stacklevel=2)
    for name, reason in left_dense:
        warnings.warn(f"to_low_rank: leaving {name!r} dense: {reason}", stacklevel=2)
    return model


# ----------------------------------------------------------------------------- selection
def _names(model: nn.Module) -> dict[int, list[str]]:
    """Every name each module is registered under, in registration order, by module identity."""
    out: dict[int, list[str]] = defaultdict(list)
    for name, mod in model.named_modules(remove_duplicate=False):
        if name not in out[id(mod)]:
            out[id(mod)].append(name)
    return out


def _classify(model: nn.Module, names_of: dict[int, list[str]], selected, per_layer: Mapping[str, int]):
    """The selected modules, as (targets to convert, already low-rank, subclasses left alone):
    lists of (name, module), each module once."""
    targets, low_rank, subclassed = [], [], []
    for name, mod in model.named_modules():
        if not selected(names_of[id(mod)]):
            continue
        if isinstance(mod, LowRank):
            low_rank.append((name, mod))
        elif _kind(mod) is not None:
            targets.append((_key(names_of[id(mod)], per_layer), mod))
        elif isinstance(mod, nn.Linear | nn.Conv2d | nn.MultiheadAttention):
            subclassed.append((name, mod))
    return targets, low_rank, subclassed


def _key(names: list[str], per_layer: Mapping[str, int]) -> str:
    """The name a module is known by here: the one a `rank` mapping uses, else its first."""
    return next((n for n in names if n in per_layer or any(f"{n}.{p}" in per_layer for p in PROJECTIONS)),
                names[0])


def _check_rank_mapping(model: nn.Module, rank: Mapping[str, int]) -> dict[str, int]:
    """A `rank` mapping's names must be modules (or projections of an nn.MultiheadAttention)."""
    modules = dict(model.named_modules(remove_duplicate=False))

    def known(name: str) -> bool:
        parent, _, child = name.rpartition(".")
        return name in modules or (child in PROJECTIONS
                                   and type(modules.get(parent)) is nn.MultiheadAttention)

    unknown = [n for n in rank if not known(n)]
    if unknown or not rank:
        raise ValueError(f"`rank` maps names that are not modules of the model: {unknown}" if unknown
                         else "`rank` is an empty mapping: it names no layer to convert")
    for name, r in rank.items():
        check_rank(r, f"rank[{name!r}]")
    return dict(rank)


def _check_filters(model: nn.Module, include: Pattern, exclude: Pattern) -> None:
    """List entries of `include` / `exclude` must name (or be a suffix of) a module."""
    names = [n for n, _ in model.named_modules(remove_duplicate=False)]
    for option, entries in (("include", include), ("exclude", exclude)):
        unknown = [e for e in entries if not any(_matches(n, [e]) for n in names)] \
            if isinstance(entries, list) else []
        # (an include list that matches nothing at all gets the message below, which lists the layers)
        if unknown and (option == "exclude" or len(unknown) < len(entries)):
            layers = [n for n, m in model.named_modules() if _kind(m) is not None or isinstance(m, LowRank)]
            raise ValueError(f"`{option}` names no module of the model: {unknown} (a list entry is a module "
                             f"name or a suffix of one; the model's layers: {', '.join(map(repr, layers))})")


def _parametrised(mod: nn.Module) -> str | None:
    """How `mod`'s weight is computed from other parameters, or None: torch.nn.utils.parametrize
    (``parametrizations.weight_norm`` / ``spectral_norm`` / ``orthogonal``) or the older hook-based
    ``torch.nn.utils.weight_norm`` / ``spectral_norm``."""
    from torch.nn.utils import parametrize

    if parametrize.is_parametrized(mod):
        kinds = sorted({type(p).__name__ for ps in mod.parametrizations.values() for p in ps})
        return f"parametrised by torch.nn.utils.parametrize ({', '.join(kinds)})"
    for hook in mod._forward_pre_hooks.values():
        if type(hook).__name__ in ("WeightNorm", "SpectralNorm"):
            return f"its weight is recomputed by torch.nn.utils.{type(hook).__name__.lower()[:-4]}_norm"
    return None


def _not_convertible(model: nn.Module, targets: list, subclassed: list) -> dict[str, str]:
    """``{name: why it stays dense}`` for selected layers to_low_rank leaves as they are: a
    parametrised weight (the low-rank factors cannot keep the parametrisation), a subclass of a
    torch layer (its forward may do more than the class it extends). Modules inside a target
    (an nn.MultiheadAttention's out_proj) are not listed, nor the parts of any attention."""
    inside = {id(c) for _, m in targets for c in list(m.modules())[1:]}
    inside |= {id(c) for m in model.modules() if isinstance(m, nn.MultiheadAttention) for c in m.children()}
    out = {}
    for name, mod in [*targets, *subclassed]:
        if id(mod) in inside:
            continue
        how = _parametrised(mod)
        if how is not None:
            out[name] = (f"{how}; a low-rank layer cannot keep it: remove it first "
                         "(torch.nn.utils.parametrize.remove_parametrizations(layer, 'weight')) to convert "
                         "the layer, or exclude it")
        elif (name, mod) in subclassed:
            out[name] = (f"{type(mod).__name__} is a subclass of {_base_class(mod)}; to_low_rank converts "
                         "the exact torch classes only (a subclass's forward may do more)")
    return out


def _base_class(mod: nn.Module) -> str:
    return next(f"nn.{c.__name__}" for c in (nn.Linear, nn.Conv2d, nn.MultiheadAttention)
                if isinstance(mod, c))


def _refuse_named(model: nn.Module, per_layer: Mapping[str, int], include: Pattern,
                  dense: dict[str, str]) -> None:
    """A `rank` mapping, or an `include` list entry, that names a module to_low_rank cannot
    convert raises (they name exactly the layers to convert); `dense`: {name: why} of the
    selected layers that stay dense."""
    modules = dict(model.named_modules(remove_duplicate=False))
    if per_layer:
        for name in per_layer:
            parent, _, child = name.rpartition(".")
            projection = child in PROJECTIONS and isinstance(modules.get(parent), nn.MultiheadAttention)
            key = parent if projection else name
            mod = modules.get(key)
            if key in dense:
                raise ValueError(f"`rank` names {key!r}, which to_low_rank cannot convert: {dense[key]}")
            if not isinstance(mod, LowRank) and _kind(mod) is None:
                raise ValueError(f"`rank` names {name!r}, a {type(mod).__name__}: to_low_rank converts "
                                 "nn.Linear, nn.Conv2d, nn.MultiheadAttention and HF Conv1D modules only")
    if isinstance(include, list):
        for entry in include:
            hits = [(n, m) for n, m in modules.items() if n and _matches(n, [entry])]
            if hits and not any(n not in dense and (_kind(m) is not None or isinstance(m, LowRank))
                                for n, m in hits):
                n, m = hits[0]
                why = dense.get(n, f"a {type(m).__name__}, not nn.Linear / nn.Conv2d / "
                                   "nn.MultiheadAttention / HF Conv1D")
                raise ValueError(f"`include` names {n!r}, which to_low_rank cannot convert: {why}")


def _check_unsharded(model: nn.Module) -> None:
    """A model already sharded (fully_shard, DTensor parameters) cannot be converted in place."""
    fsdp = fsdp_classes()
    sharded = next((n for n, m in model.named_modules() if fsdp and isinstance(m, fsdp)), None)
    if sharded is None:
        sharded = next((n for n, p in model.named_parameters() if type(p).__name__ == "DTensor"
                        or type(getattr(p, "data", None)).__name__ == "DTensor"), None)
    if sharded is not None:
        raise ValueError(f"to_low_rank: the model is already sharded ({_show(sharded)}: fully_shard, DTensor "
                         "parameters): convert it first, then shard (to_low_rank(model, …), then "
                         "fully_shard); DLRT/SDLRT do not train FSDP-sharded models yet (use process_group=)")


def _check_tensor_hooks(targets: list) -> None:
    """A hook on a layer's weight tensor (``weight.register_hook``) cannot move to the factors."""
    for name, mod in targets:
        for pname, p in mod.named_parameters():
            if getattr(p, "_backward_hooks", None) or getattr(p, "_post_accumulate_grad_hooks", None):
                raise ValueError(f"{_show(name)}.{pname} has a tensor hook (register_hook / "
                                 "register_post_accumulate_grad_hook); its low-rank layer has no such tensor "
                                 "(it holds U, S, V): register the hook on the converted layer's factors, "
                                 "or a module hook, after to_low_rank")


def _tied(model: nn.Module, targets: list) -> dict[str, list[str]]:
    """``{target name: [names of the parameters it shares with modules outside it]}`` for the
    targets holding a Parameter that another module holds too (tied weights)."""
    owners: dict[int, list[tuple[str, nn.Module]]] = defaultdict(list)
    for mname, mod in model.named_modules(remove_duplicate=False):
        for pname, p in mod.named_parameters(recurse=False):
            owners[id(p)].append((f"{mname}.{pname}" if mname else pname, mod))
    tied = {}
    for name, mod in targets:
        inside = {id(m) for m in mod.modules()}
        shared = [n for p in mod.parameters() for n, owner in owners[id(p)] if id(owner) not in inside]
        if shared:
            tied[name] = list(dict.fromkeys(shared))
    return tied


def _tied_text(tied: dict[str, list[str]]) -> str:
    return "; ".join(f"{_show(n)} (shares {', '.join(map(repr, shared))})" for n, shared in tied.items())


def _check_meta(targets: list, tau: float | None, target: float | None) -> None:
    meta = [n for n, m in targets if any(p.is_meta for p in m.parameters())]
    if meta and (tau is not None or target is not None):
        raise ValueError(f"to_low_rank: {_show(meta[0])} is on the meta device (no values): `tau` and "
                         "`target` need the weights' singular values; give `rank=` alone to build meta "
                         "low-rank layers of that rank, or convert after loading the weights")


# ----------------------------------------------------------------------------- conversion
def own_rng(*modules: nn.Module):
    """A context in which random draws (a new layer's own initialisation, overwritten at once)
    leave the user's generators as they were: the same seed gives the same data order and
    dropout masks with or without a conversion."""
    devices = {t.device for m in modules for t in m.parameters()} | {torch.get_default_device()}
    cuda = sorted({d.index or 0 for d in devices if d.type == "cuda"})
    return torch.random.fork_rng(devices=cuda)


_HOOK_DICTS = ("_forward_hooks", "_forward_hooks_with_kwargs", "_forward_hooks_always_called",
               "_forward_pre_hooks", "_forward_pre_hooks_with_kwargs", "_backward_hooks",
               "_backward_pre_hooks", "_state_dict_hooks", "_state_dict_pre_hooks",
               "_load_state_dict_pre_hooks", "_load_state_dict_post_hooks")


def carry_over(old: nn.Module, new: nn.Module) -> None:
    """What the user attached to the dense `old` moves to its low-rank replacement `new`:

    - ``requires_grad``: a frozen weight gives frozen factors U, S, V, a frozen bias stays
      frozen (an attention's, per projection);
    - module hooks (forward, pre-forward, backward, state-dict): the same hook dictionaries, so
      the handles the user holds still remove them."""
    pairs = [(old, new)]
    if isinstance(new, LowRankMultiheadAttention):
        trios = [(getattr(new, p), w, b) for p, (w, b) in dense_projections(old).items()]
        pairs.append((old.out_proj, new.out_proj))
    else:
        trios = [(new, old.weight, old.bias)]
    for layer, w, b in trios:
        for t in (layer.U, layer.S, layer.V):
            t.requires_grad_(w.requires_grad)
        if b is not None:
            layer.bias.requires_grad_(b.requires_grad)
    for src, dst in pairs:
        for attr in _HOOK_DICTS:
            if hasattr(src, attr):
                setattr(dst, attr, getattr(src, attr))
        if getattr(src, "_is_full_backward_hook", None) is not None:
            dst._is_full_backward_hook = src._is_full_backward_hook


def _unsupported(mod: nn.Module) -> str | None:
    """Why `mod` (a target) has no low-rank equivalent, or None."""
    kind = _kind(mod)
    if kind == "conv":
        return LowRankConv2d.unsupported(mod)
    return attention_unsupported(mod) if kind == "attention" else None


def _matrices(name: str, mod: nn.Module) -> dict[str, torch.Tensor]:
    """The weight matrices (out, in) a target is converted from, by the names its ranks take."""
    if _kind(mod) == "attention":
        return {f"{name}.{p}": w for p, (w, _) in dense_projections(mod).items()}
    W = mod.weight
    return {name: W.mT if _kind(mod) == "conv1d" else W.reshape(W.shape[0], -1)}


def _expand_attention(per_layer: dict[str, int], targets: list) -> dict[str, int]:
    """A `rank` mapping with every attention target's rank given per projection."""
    ranks = dict(per_layer)
    for name, mod in targets:
        if _kind(mod) != "attention":
            continue
        given = {p: per_layer.get(f"{name}.{p}", per_layer.get(name)) for p in PROJECTIONS}
        missing = [f"{name}.{p}" for p, r in given.items() if r is None]
        if missing:
            raise ValueError(f"`rank` names some projections of the attention {name!r} but not {missing}: "
                             f"name all four, or {name!r} itself for one rank")
        ranks.update({f"{name}.{p}": r for p, r in given.items()})
    return ranks


def _rank_of(name: str, mod: nn.Module, ranks: dict[str, int], rank: int | None):
    """A target's rank: an int (or None with `tau`), per projection for an attention."""
    if _kind(mod) == "attention":
        return {p: ranks.get(f"{name}.{p}", rank) for p in PROJECTIONS}
    return ranks.get(name, rank)


def _fix_capacity(new: nn.Module, capacity: int | str, max_rank: int | None) -> None:
    """Every low-rank layer in `new` (a layer, or an attention's projections) at a fixed capacity:
    `capacity`, or ``"auto"``: twice its rank (capped by `max_rank`)."""

    for m in new.modules():
        if isinstance(m, AbstractLowRankLayer):
            R = 2 * m.rank if capacity == "auto" else capacity
            m.set_capacity(max(m.rank, min(R, max_rank)) if max_rank is not None else max(m.rank, R))


def _low_rank(mod: nn.Module, rank, tau: float | None, max_rank: int | None) -> nn.Module:
    """The low-rank replacement of one target (on meta: built at `rank`, no SVD)."""
    if any(p.is_meta for p in mod.parameters()):
        with torch.device("meta"):
            return _meta_low_rank(mod, rank, max_rank)
    kind = _kind(mod)
    cls = {"linear": LowRankLinear, "conv": LowRankConv2d, "conv1d": LowRankConv1D,
           "attention": LowRankMultiheadAttention}[kind]
    return cls.from_dense(mod, rank=rank, tau=tau, max_rank=max_rank)


def _meta_low_rank(mod: nn.Module, rank, max_rank: int | None) -> nn.Module:
    """A low-rank layer shaped like `mod` at `rank` (clamped), from the constructor alone."""
    kind = _kind(mod)
    if kind == "attention":
        W = mod.out_proj.weight
        return LowRankMultiheadAttention(
            mod.embed_dim, mod.num_heads, rank, dropout=mod.dropout, bias=mod.in_proj_bias is not None,
            kdim=mod.kdim, vdim=mod.vdim, batch_first=mod.batch_first, max_rank=max_rank, dtype=W.dtype)
    W = mod.weight
    out, inn = (W.shape[1], W.shape[0]) if kind == "conv1d" else (W.shape[0], W[0].numel())
    r = min(rank, out, inn)
    kw = {"bias": mod.bias is not None, "max_rank": max(r, max_rank) if max_rank else None, "dtype": W.dtype}
    if kind == "linear":
        return LowRankLinear(mod.in_features, mod.out_features, r, **kw)
    if kind == "conv1d":
        return LowRankConv1D(mod.nf, mod.nx, r, **kw)
    return LowRankConv2d(mod.in_channels, mod.out_channels, mod.kernel_size, r, stride=mod.stride,
                         padding=mod.padding, dilation=mod.dilation, **kw)


@torch.no_grad()
def _target_ranks(model: nn.Module, targets: list, target: float, allocation: str) -> dict[str, int]:
    """Ranks of the dense `targets` (by matrix: an attention's per projection) that bring the
    model's compression to `target` (``max_rank`` of :func:`to_low_rank` caps later growth, not
    these ranks)."""
    c = compression(model)
    weights = {k: w for name, mod in targets for k, w in _matrices(name, mod).items()}
    fixed = c["stored_params"] - sum(w.numel() for w in weights.values())  # biases, other layers
    budget = (1 - target) * c["dense_params"] - fixed
    if budget <= 0:
        raise ValueError(f"`target`={target} cannot be reached: the parameters that stay as they are "
                         f"(biases, other layers) alone are {fixed:,} of {c['dense_params']:,}")
    spectra = {n: torch.linalg.svdvals(w.detach().to(work_dtype(w.dtype))) for n, w in weights.items()}
    shapes = {n: tuple(w.shape) for n, w in weights.items()}
    return allocate_ranks(spectra, shapes, budget, min_rank=1, rule=allocation)


# ----------------------------------------------------------------------------- messages
def _nothing_converted(model: nn.Module, include: Pattern, exclude: Pattern, low_rank: list,
                       subclassed: list, left_dense: list, tied: dict[str, list[str]]) -> str:
    """The error message of a call of :func:`to_low_rank` that would convert no layer."""
    filters = ", ".join(f"{k}={v!r}" for k, v in (("include", include), ("exclude", exclude))
                        if v is not None)
    where = f" matching {filters}" if filters else ""
    msg = "to_low_rank converted nothing"
    names = ", ".join(f"{_show(n)} ({type(m).__name__}, rank {_rank_text(m)})" for n, m in low_rank)
    already = f"; already low-rank: {names}" if names else ""
    if tied or left_dense:
        parts = [f"{_show(n)}: {e}" for n, e in left_dense]
        if tied:
            parts.append(f"tied weights (left dense so the tie holds): {_tied_text(tied)}")
        return (f"{msg}: every layer{where} is left dense: a convolution LowRankConv2d cannot express, "
                f"an attention it cannot express, or a tied weight ({'; '.join(parts)}){already}; "
                "the model was not changed")
    if low_rank:
        return (f"{msg}: the layers{where} are already low-rank: {names}. to_low_rank only "
                "converts nn.Linear / nn.Conv2d (and nn.MultiheadAttention, HF Conv1D); to start from "
                "another rank, build the dense model again and convert that (a trained model: copy its "
                "weights into a fresh dense model via dense_weight()); during training ranks change "
                "through the optimizer's truncation (`tau`, `max_rank` of DLRT/SDLRT)")
    dense = [n for n, m in model.named_modules() if _kind(m) is not None]
    if filters and dense:
        shown = ", ".join(_show(n) for n in dense[:10]) + (", ..." if len(dense) > 10 else "")
        hint = (f"; its convertible modules are: {shown} (a str filter is a regex "
                "matched against the full name, a list holds names or name suffixes)")
    else:
        hint = "; the model has no nn.Linear / nn.Conv2d module (nor nn.MultiheadAttention, HF Conv1D)"
    if subclassed:
        hint += ("; subclasses of nn.Linear / nn.Conv2d / nn.MultiheadAttention are not converted: "
                 + ", ".join(f"{_show(n)} ({type(m).__name__})" for n, m in subclassed[:10]))
    return f"{msg}: no nn.Linear / nn.Conv2d{where} in the model{hint}"


def _rank_text(m: nn.Module) -> str:
    if isinstance(m, LowRankMultiheadAttention):
        return "/".join(str(r) for r in m.ranks.values())
    return str(m.rank)


def _show(name: str) -> str:
    return repr(name) if name else "<root module>"


def set_submodule(model: nn.Module, name: str, new: nn.Module) -> None:
    if name == "":
        raise ValueError("to_low_rank cannot replace the root module itself; wrap it first")
    parent_name, _, child = name.rpartition(".")
    parent = model.get_submodule(parent_name) if parent_name else model
    setattr(parent, child, new)
