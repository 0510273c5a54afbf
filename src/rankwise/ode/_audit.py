"""Gradient audit: reversal backprop against dense autograd through the stored graph."""

from __future__ import annotations

import logging
from collections.abc import Callable

import torch
from torch import Tensor, nn

from ._block import LowRankODEBlock
from ._state import LowRankState

log = logging.getLogger(__name__)


def audit_gradients(module: nn.Module, inputs: LowRankState | Tensor,
                    loss_fn: Callable[[LowRankState], Tensor]) -> float:
    """Cosine between the reversal gradient and dense autograd through the stored graph (same
    schedule), over all trainable parameters of ``module`` and the input. ``module`` is a
    :class:`LowRankODEBlock` or any module containing some (each replays its last schedule);
    ``loss_fn`` maps ``module(inputs)`` to a scalar. Logged at INFO."""
    blocks = [b for b in module.modules() if isinstance(b, LowRankODEBlock)]
    if not blocks:
        raise ValueError("audit_gradients: the module contains no LowRankODEBlock")
    params = [p for p in module.parameters() if p.requires_grad]

    def grads(reversible: bool) -> Tensor:
        x = inputs.detach().clone().requires_grad_(True) if isinstance(inputs, Tensor) else \
            LowRankState(*(t.detach().clone().requires_grad_(True) for t in (inputs.X, inputs.S, inputs.V)))
        leaves = [x] if isinstance(x, Tensor) else [x.X, x.S, x.V]
        for b in blocks:
            b.reversible = reversible
        loss = loss_fn(module(x))
        gs = torch.autograd.grad(loss, [*leaves, *params], allow_unused=True)
        return torch.cat([torch.zeros(0) if gr is None else gr.reshape(-1).double() for gr in gs])

    was = [b.reversible for b in blocks]
    try:
        g_rev = grads(True)
        for b in blocks:  # the reference follows the same schedules
            b._replay = b.last_tape
        g_ref = grads(False)
    finally:
        for b, w in zip(blocks, was, strict=True):
            b.reversible, b._replay = w, None
    cos = float(g_rev @ g_ref / (g_rev.norm() * g_ref.norm() + 1e-300))
    log.info("audit_gradients: cosine %.12f", cos)
    return cos
