r"""An exponential moving average of a low-rank model's weights that survives rank changes.

``torch.optim.swa_utils.AveragedModel`` averages a model's parameters tensor by tensor. For a
low-rank layer those are the factors U, S, V: their shapes change at every rank change (and
AveragedModel then fails on the shape mismatch), and the integrator rotates the bases at every
augmentation, so an average of factors is not the factorisation of an averaged weight even
while the ranks hold. :class:`DenseEMA` averages what the layer computes with, its dense weight
W = U S Vᵀ, in a plain-PyTorch dense copy of the model (:func:`rankwise.export` with
``merge="always"``), whose shapes never change.
"""

from __future__ import annotations

from collections.abc import Collection
from typing import Any

import torch
from torch import Tensor, nn

from ..nn._base import AbstractLowRankLayer
from ..nn._export import export


def dense_parameters(model: nn.Module, replaced: Collection[str] = ()) -> dict[str, Tensor]:
    """{name: tensor} of `model`'s weights as its dense export names them: for a low-rank layer
    ``<layer>.weight``, its dense weight (:meth:`AbstractLowRankLayer.dense_weight`, in the
    shape of the matching torch layer's weight), and its other parameters (the bias); for a
    module named in `replaced` (one that the export replaces by a module with other parameter
    names, e.g. a ``LowRankMultiheadAttention`` by an ``nn.MultiheadAttention``), the
    parameters of its dense export; every other parameter as it is. Detached. A parameter
    reachable under several names (tied weights) appears under each."""
    out: dict[str, Tensor] = {}
    units: set[str] = set()  # modules whose parameters are read here: not descended into
    for name, m in model.named_modules(remove_duplicate=False):
        parts = name.split(".") if name else []
        if any(".".join(parts[:i]) in units for i in range(len(parts))):
            continue
        prefix = f"{name}." if name else ""
        if name in replaced:
            units.add(name)
            out.update({prefix + n: p.detach() for n, p in export(m, merge="always").named_parameters()})
        elif isinstance(m, AbstractLowRankLayer):
            units.add(name)
            out[f"{prefix}weight"] = m.dense_weight().detach()
            factors = {id(m.U), id(m.S), id(m.V)}
            out.update({prefix + n: p.detach() for n, p in m.named_parameters(recurse=False)
                        if id(p) not in factors})
        else:
            out.update({prefix + n: p.detach() for n, p in m.named_parameters(recurse=False)})
    return out


def replaced_modules(model: nn.Module, dense: nn.Module) -> tuple[str, ...]:
    """Names of the modules of `model` other than low-rank layers that its export `dense`
    replaced by a module of another type (rankwise's own composite layers)."""
    mine = dict(dense.named_modules(remove_duplicate=False))
    return tuple(n for n, m in model.named_modules(remove_duplicate=False)
                 if n in mine and not isinstance(m, AbstractLowRankLayer) and type(mine[n]) is not type(m))


class DenseEMA(nn.Module):
    r"""An exponential moving average of `model`'s dense weights, as
    ``AveragedModel(model, multi_avg_fn=get_ema_multi_avg_fn(decay))`` computes it for a dense
    model, through rank changes.

    ``module`` is a plain-PyTorch dense copy of `model` (``rankwise.export(model,
    merge="always")``: every low-rank layer an ``nn.Linear`` / ``nn.Conv2d``) made once;
    :meth:`update_parameters` then sets each of its parameters, as AveragedModel does, to the
    model's current value at the first call and to ``decay·E + (1 − decay)·W`` afterwards, with
    ``W`` a low-rank layer's dense weight U S Vᵀ (:func:`dense_parameters`), the parameters of
    the dense export of a composite low-rank module (a ``LowRankMultiheadAttention``'s
    ``in_proj_weight``, ...), or the parameter itself. Buffers (BatchNorm statistics) are
    copied from the model at each update, as AveragedModel's default ``use_buffers=False``
    does (``torch.optim.swa_utils.update_bn(loader, ema.module)`` recomputes them for the
    averaged weights). Calling the EMA runs ``module``.

    **Arguments:** `model` (holding :class:`LowRankLinear` / :class:`LowRankConv2d` layers, or
    none), `decay` in [0, 1] (torch's default 0.999).

    **Raises:** ``ValueError`` for a `decay` outside [0, 1]; ``TypeError`` for a model holding
    rankwise modules with no dense export (adapters: average
    ``rankwise.peft.merge_and_unload`` of a copy, or the adapters' own factors, instead).

    Example: ``ema = DenseEMA(model, 0.999)``; after every ``opt.step()``,
    ``ema.update_parameters(model)``; evaluate ``ema.module`` (or ``ema(x)``).
    """

    n_averaged: Tensor

    def __init__(self, model: nn.Module, decay: float = 0.999) -> None:
        super().__init__()
        if isinstance(decay, bool) or not isinstance(decay, int | float) or not 0 <= decay <= 1:
            raise ValueError(f"`decay` must be a number in [0, 1] (torch's EMA default 0.999); got {decay!r}")
        self.decay = float(decay)
        try:
            self.module = export(model, merge="always")  # (which leaves the global RNG alone)
        except TypeError as e:
            raise TypeError(f"DenseEMA averages a dense copy of the model, and {e}") from None
        self._replaced = replaced_modules(model, self.module)
        sources = dense_parameters(model, self._replaced)
        for name, p in self.module.named_parameters():
            if name not in sources or sources[name].shape != p.shape:
                raise TypeError(f"DenseEMA: the dense copy's parameter {name!r} {tuple(p.shape)} has no "
                                "counterpart in the model (a module whose export renames its parameters)")
        self.register_buffer("n_averaged", torch.tensor(0, dtype=torch.long, device=_device(self.module)))

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return self.module(*args, **kwargs)

    @torch.no_grad()
    def update_parameters(self, model: nn.Module) -> None:
        """Average `model`'s current dense weights into :attr:`module` (copy them at the first
        call), and copy its buffers. `model` must be the model the EMA was made from (or one of
        the same structure), at any ranks."""
        sources = dense_parameters(model, self._replaced)
        mine = dict(self.module.named_parameters())
        if missing := sorted(set(mine) - set(sources)):
            raise ValueError(f"DenseEMA.update_parameters: `model` has no {missing[:4]}: pass the model "
                             "the EMA was made from")
        ema = [p.detach() for p in mine.values()]
        new = [sources[n].to(p.device, p.dtype) for n, p in mine.items()]
        if int(self.n_averaged) == 0:
            torch._foreach_copy_(ema, new)
        else:
            torch._foreach_lerp_(ema, new, 1 - self.decay)
        self.n_averaged += 1
        buffers = dict(model.named_buffers())
        for name, b in self.module.named_buffers():
            if name in buffers:
                b.copy_(buffers[name])

    update = update_parameters


def _device(module: nn.Module) -> torch.device:
    return next((t.device for t in module.parameters()), torch.device("cpu"))
