"""FSDP2 (``torch.distributed.fsdp.fully_shard``) around the same step: the "gathered" placement.

Under ``fully_shard`` a fixed-capacity layer's U (m, R), S (R, R), V (n, R) are ``Shard(0)``
DTensors, and after the backward so are their gradients (FSDP2's reduce-scatter: the mean over the
ranks of G_K, G_S, G_L) and the optimizer's moments (made as ``zeros_like`` the parameter, so
sharded too: :func:`._state.materialise`). The integrator needs whole rows and columns (a QR of
[U0, ΔK], an SVD of the core), so for one step :func:`gathered` gives the step a plain full copy of
each layer — its factors, gradients and moments all-gathered (``full_tensor``) — runs the same
functions on every rank, then writes each rank's rows back into its shards; SDLRT's buffers and the
live rank are module buffers, which FSDP2 leaves whole on every rank, and are written in place.
Dense parameters (norms, embeddings) take their rule on their DTensor shards directly. Every rank
computes the same result from the same gathered inputs, so the ranks agree exactly.

What it costs: persistent memory is sharded (factors, gradients, moments); the step holds the
gathered copies of every layer while it runs, and every rank integrates every layer (an owner
placement, each layer on one rank, is what would divide that work).
"""

from __future__ import annotations

import contextlib

import torch
from torch import Tensor, nn
from torch.optim import Optimizer

from ...nn._base import AbstractLowRankLayer


def is_dtensor(t: Tensor | None) -> bool:
    return t is not None and type(t).__name__ == "DTensor" and hasattr(t, "full_tensor")


def sharded(model: nn.Module) -> bool:
    """Does any low-rank layer of `model` hold DTensor factors (FSDP2)?"""
    return any(isinstance(m, AbstractLowRankLayer) and is_dtensor(m.U) for m in model.modules())


def _full(t):
    return t.full_tensor() if is_dtensor(t) else t


def _put(dst: Tensor, full: Tensor) -> None:
    """Write this rank's part of `full` into `dst` (a DTensor: its local shard; else all of it)."""
    if is_dtensor(dst):
        from torch.distributed.tensor import distribute_tensor

        mine = distribute_tensor(full.to(dst.dtype), dst.device_mesh, dst.placements, src_data_rank=None)
        dst.to_local().copy_(mine.to_local())
    else:
        dst.copy_(full)


class _Gathered(AbstractLowRankLayer):
    """A plain, full copy of a sharded layer for one step: U, S, V and their gradients gathered,
    SDLRT's buffers and ``live`` the layer's own (shared)."""

    def __init__(self, layer: AbstractLowRankLayer) -> None:  # (no AbstractLowRankLayer.__init__: no init)
        nn.Module.__init__(self)
        self.out_features, self.in_features = layer.out_features, layer.in_features
        self.max_rank, self.capacity, self.grad_mode = layer.max_rank, layer.capacity, layer.grad_mode
        for k in ("U", "S", "V"):
            real = getattr(layer, k)
            p = nn.Parameter(_full(real.detach()).clone(), requires_grad=real.requires_grad)
            p.grad = None if real.grad is None else _full(real.grad)
            self.register_parameter(k, p)
        self.register_buffer("U_buf", layer.U_buf)
        self.register_buffer("V_buf", layer.V_buf)
        self.register_buffer("live", layer.live)
        self._set_live(*layer._live)
        self._guard_parameters()

    def dense_weight(self) -> Tensor:
        return self.weight_matrix()


@contextlib.contextmanager
def gathered(opt: Optimizer):
    """Within the block, ``opt.layers`` are full plain copies of the sharded layers (with their
    optimizer states and param groups), so that the step runs unchanged; on leaving, each rank's
    rows of the new factors and moments go back into its shards, and the live ranks into the layers."""
    real = dict(opt.layers)
    copies = {n: _Gathered(m) for n, m in real.items()}
    groups = {id(p): opt._hp_of(p) for m in real.values() for p in (m.U, m.S, m.V)}
    saved_groups = opt._group_by_id
    for n, m in real.items():
        for k in ("U", "S", "V"):
            st = opt.state[getattr(m, k)]
            opt.state[getattr(copies[n], k)] = {key: _full(v) for key, v in st.items()}
    pairs = [(p, q) for n, m in real.items()
             for p, q in zip((m.U, m.S, m.V), (copies[n].U, copies[n].S, copies[n].V), strict=True)]
    opt._group_by_id = {**{id(q): groups[id(p)] for p, q in pairs},
                        **(saved_groups or {id(q): g for g in opt.param_groups for q in g["params"]})}
    opt.layers = copies
    try:
        yield
    finally:
        opt.layers = real
        opt._group_by_id = None
        with torch.no_grad():
            for n, m in real.items():
                c = copies[n]
                for k in ("U", "S", "V"):
                    p, q = getattr(m, k), getattr(c, k)
                    _put(p, q.detach())
                    new = opt.state.pop(q)
                    old = opt.state[p]
                    for key, v in new.items():
                        if torch.is_tensor(v) and torch.is_tensor(old.get(key)) and is_dtensor(old[key]):
                            _put(old[key], v)
                        else:
                            old[key] = v
                    if q.grad is None:
                        p.grad = None
                m._set_live(*c._live)
