"""Training memory counted from the tensors a model and its optimizer hold."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor, nn


@dataclass(frozen=True)
class MemoryCount:
    """Bytes held for training, each tensor counted once (by storage):

    - ``weights``: the parameters (frozen ones included);
    - ``grads``: their ``.grad`` tensors, and a low-rank layer's factor gradients G_K, G_L
      (which the integrator reads instead of U's and V's ``.grad``);
    - ``optimizer``: every tensor in the optimizer's state (moments, step counters, GaLore's
      projection matrices, the integrator's moments of K, L and S);
    - ``lowrank_buffers``: SDLRT's compensation buffers (``U_buf``, ``V_buf``).
    """

    weights: int
    grads: int
    optimizer: int
    lowrank_buffers: int

    @property
    def total(self) -> int:
        return self.weights + self.grads + self.optimizer + self.lowrank_buffers


def training_memory(model: nn.Module, optimizer: torch.optim.Optimizer | None = None) -> MemoryCount:
    """Count the bytes of `model`'s weights and gradients and of `optimizer`'s state (call it
    after a backward and a step to see gradients and state). See :class:`MemoryCount`."""
    from .nn._base import AbstractLowRankLayer

    seen: set[tuple[int, int]] = set()

    def size(t: Tensor | None) -> int:
        if t is None or not isinstance(t, Tensor) or t.numel() == 0:
            return 0
        key = (t.untyped_storage().data_ptr(), t.storage_offset())
        if key in seen:
            return 0
        seen.add(key)
        return t.numel() * t.element_size()

    weights = sum(size(p) for p in model.parameters())
    grads = sum(size(p.grad) for p in model.parameters())
    buffers = 0
    for m in model.modules():
        if isinstance(m, AbstractLowRankLayer):
            buffers += size(m.U_buf) + size(m.V_buf)
    state = 0 if optimizer is None else sum(_state_bytes(v, size, 0) for v in optimizer.state.values())
    return MemoryCount(weights, grads, state, buffers)


def _state_bytes(value, size, depth: int) -> int:
    """Tensors inside an optimizer state value: dicts, lists, tuples and the attributes of
    plain objects (GaLore keeps its projection matrix in a projector object), 4 levels deep."""
    if isinstance(value, Tensor):
        return size(value)
    if depth >= 4 or isinstance(value, (str, bytes, int, float, bool)) or value is None:
        return 0
    if isinstance(value, dict):
        items = value.values()
    elif isinstance(value, (list, tuple)):
        items = value
    elif hasattr(value, "__dict__"):
        items = vars(value).values()
    else:
        return 0
    return sum(_state_bytes(v, size, depth + 1) for v in items)
