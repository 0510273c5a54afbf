"""A dense warm start for :func:`fit`: train dense, then factorise and hand over to an integrator.

The best recipe the studies found for a compression target on the digits MLP (docs/sdlrt.md,
``dlrt-warm`` in the sweep) is: train the dense model for a while, factorise every layer by its
SVD (at full rank: nothing is lost), then let DLRT's budget fall to the target over the rest of
the run. :class:`DenseWarmStart` is that recipe as one callback.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence

import torch
from torch import nn

from .._checks import check_rank
from ._loop import Callback, Loop


class DenseWarmStart(Callback):
    """After `steps` optimizer steps of the dense model, replace its ``nn.Linear`` /
    ``nn.Conv2d`` layers by their SVDs (:func:`rankwise.to_low_rank`, in place: the model
    object stays the same) and continue with ``optimizer(model)``, e.g. a
    :class:`rankwise.DLRT` whose :class:`rankwise.Budget` ramps from the factored model's size
    down to the target.

    **Arguments:**
    - `steps` >= 1: dense steps before the switch (counted in the run's ``global_step``).
    - `optimizer(model) -> Optimizer`: the second phase's optimizer, built on the factored model.
    - `rank`: the factors' rank (``None``: full rank, min(out, in) per layer: the switch changes no
      output, up to roundoff), or ``{module name: rank}`` (the layers to factor, each at its own
      rank); `include` / `exclude`: as :func:`rankwise.to_low_rank`.

    The learning rate the dense phase ended with is carried into the new optimizer's param
    groups when `carry_lr` (default), so a schedule that sets the groups' rates goes on.

    Example::

        rankwise.fit(model, torch.optim.AdamW(model.parameters(), 1e-3), x, y, epochs=30,
                     callbacks=[DenseWarmStart(2500, lambda m: rankwise.DLRT(
                         m, 1e-3, target=0.9, ramp_steps=400, optimizer="adam"))])

    A run resumed by :class:`rankwise.train.CodedCheckpoints` after the switch needs the model
    factored before the restore (build it with ``to_low_rank`` at the same ranks); this callback
    does not do that for you.
    """

    def __init__(self, steps: int, optimizer: Callable[[nn.Module], torch.optim.Optimizer], *,
                 rank: int | Mapping[str, int] | None = None, include: str | Sequence[str] | None = None,
                 exclude: str | Sequence[str] | None = None, carry_lr: bool = True) -> None:
        if isinstance(steps, bool) or not isinstance(steps, int) or steps < 1:
            raise ValueError(f"`steps` must be an int >= 1 (dense steps before the switch); got {steps!r}")
        if not callable(optimizer):
            raise TypeError("`optimizer` must be a function model -> optimizer (e.g. "
                            "lambda m: rankwise.DLRT(m, 1e-3, target=0.9, ramp_steps=400))")
        if isinstance(rank, Mapping):
            if include is not None or exclude is not None:
                raise ValueError("a `rank` mapping names the layers to factor: give it without `include` or "
                                 "`exclude`")
            for name, r in rank.items():
                check_rank(r, f"rank[{name!r}]")
            rank = dict(rank)
        elif rank is not None:  # (None: full rank)
            check_rank(rank)
        self.steps, self.make, self.rank = steps, optimizer, rank
        self.include, self.exclude, self.carry_lr = include, exclude, carry_lr
        self.switched_at: int | None = None

    def on_step_end(self, loop: Loop) -> None:
        if loop.global_step != self.steps:
            return
        from ..nn import to_low_rank

        model = loop.model
        rank = self.rank
        if rank is None:  # full rank: the largest dimension, clamped per layer to min(out, in)
            rank = max((max(p.shape[:2]) for p in model.parameters() if p.ndim >= 2), default=1)
        lr = loop.optimizer.param_groups[0].get("lr")
        to_low_rank(model, rank=rank, include=self.include, exclude=self.exclude)
        new = self.make(model)
        if not isinstance(new, torch.optim.Optimizer):
            raise TypeError(f"DenseWarmStart's `optimizer` returned {type(new).__name__}, "
                            "not a torch optimizer")
        if self.carry_lr and lr is not None:
            for g in new.param_groups:
                g["lr"] = lr
        loop.optimizer = new
        self.switched_at = loop.global_step
