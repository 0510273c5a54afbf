"""The sharded integrator's pieces: which rank integrates which layer, and moving a layer's
new factors and optimizer state from its owner to every rank.

Under ``AugmentedBUG(..., process_group=g, settings with data_parallel="sharded")`` each
low-rank layer is integrated by one rank of `g`, its *owner*; every rank still runs forward and
backward on its shard of the batch and averages the gradients. After the truncation each owner
sends its layers' factors, buffers, τ and optimizer state to the others, so every rank holds
the same complete model and optimizer state (a ``state_dict`` on any rank is whole).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from ..dist import global_rank


def layer_cost(out_features: int, in_features: int, rank: int) -> float:
    """The integrator's arithmetic for one layer at `rank` (its largest), up to a constant: the
    QRs of the (out, 2r) and (in, 2r) augmented bases and the SVD of the 2r × 2r core,
    ``(m + n)(2r)² + (2r)³``."""
    r2 = 2 * rank
    return float((out_features + in_features) * r2 * r2 + r2 ** 3)


def assign_owners(costs: Mapping[str, float], world: int) -> dict[str, int]:
    """{layer: owning rank}: the longest-processing-time rule (layers by decreasing cost, each
    to the rank with the least cost so far; ties to the lower rank, equal costs in the given
    order). A pure function of the costs and the order of the layers, so identical on every
    rank and after a restart (costs from the layers' shapes and rank caps, not their ranks)."""
    if world < 1:
        raise ValueError(f"`world` must be >= 1; got {world}")
    load = [0.0] * world
    owners: dict[str, int] = {}
    for name in sorted(costs, key=lambda n: -costs[n]):  # sorted() is stable: ties keep their order
        r = min(range(world), key=lambda i: (load[i], i))
        owners[name] = r
        load[r] += costs[name]
    return {n: owners[n] for n in costs}


def _split(value: Any, tensors: list[Tensor]) -> Any:
    """`value` (nested dicts, lists, tuples, scalars, tensors) with every tensor replaced by a
    placeholder ``("__tensor__", index, shape, dtype)`` and appended to `tensors`."""
    if torch.is_tensor(value):
        tensors.append(value)
        return ("__tensor__", len(tensors) - 1, tuple(value.shape), str(value.dtype).removeprefix("torch."))
    if isinstance(value, dict):
        return {k: _split(v, tensors) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return type(value)(_split(v, tensors) for v in value)
    return value


def _is_placeholder(value: Any) -> bool:
    return isinstance(value, tuple) and len(value) == 4 and value[0] == "__tensor__"


def _join(value: Any, tensors: list[Tensor]) -> Any:
    """Inverse of :func:`_split`."""
    if _is_placeholder(value):
        return tensors[value[1]]
    if isinstance(value, dict):
        return {k: _join(v, tensors) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return type(value)(_join(v, tensors) for v in value)
    return value


def _placeholders(value: Any, out: list[tuple]) -> list[tuple]:
    if _is_placeholder(value):
        out.append(value)
    elif isinstance(value, dict):
        for v in value.values():
            _placeholders(v, out)
    elif isinstance(value, list | tuple):
        for v in value:
            _placeholders(v, out)
    return out


def share_from_owners(mine: Mapping[str, Any], owners: Mapping[str, int], group,
                      device: torch.device) -> tuple[dict[str, Any], int]:
    """Every rank's values for the layers it owns, on every rank.

    `mine`: {layer: value} for the layers this rank owns and has news of (a value: nested
    dicts / lists / tuples of tensors and plain data). Returns ({layer: value} for every
    layer of every rank, tensors on `device`, each a compact copy, this rank's own too) and the bytes
    of tensor data this rank sent. One ``all_gather_object`` of the structure (shapes, dtypes,
    scalars), then per owner one broadcast per dtype of its tensors, flattened."""
    me = dist.get_rank(group)
    world = dist.get_world_size(group)
    tensors: list[Tensor] = []
    skeleton = {name: _split(v, tensors) for name, v in mine.items()}
    skeletons: list[Any] = [None] * world
    dist.all_gather_object(skeletons, skeleton, group=group)
    for r, sk in enumerate(skeletons):
        if any(owners.get(name) != r for name in sk):
            bad = next(name for name in sk if owners.get(name) != r)
            raise RuntimeError(f"rank {r} sent the state of layer {bad!r}, which it does not own")
    out: dict[str, Any] = {}
    sent = 0
    for r, sk in enumerate(skeletons):
        if not sk:
            continue
        slots = _placeholders(sk, [])
        theirs: list[Tensor | None] = [None] * len(slots)
        by_dtype: dict[str, list[tuple]] = {}
        for ph in slots:
            by_dtype.setdefault(ph[3], []).append(ph)
        for dtype_name, phs in by_dtype.items():
            dtype = getattr(torch, dtype_name)
            sizes = [math.prod(ph[2]) for ph in phs]
            if r == me:
                flat = torch.cat([tensors[ph[1]].detach().reshape(-1).to(device) for ph in phs])
                sent += flat.numel() * flat.element_size()
            else:
                flat = torch.empty(sum(sizes), dtype=dtype, device=device)
            dist.broadcast(flat, src=global_rank(group, r), group=group)
            for ph, part in zip(phs, torch.split(flat, sizes), strict=True):
                theirs[ph[1]] = part.view(ph[2]).clone()
        # the owner too takes the copies: every rank then holds tensors of one layout (compact,
        # each its own storage), so serialising the state gives the same bytes on every rank
        out.update({name: _join(v, theirs) for name, v in sk.items()})  # type: ignore[arg-type]
    return out, sent


def gather_objects(mine: Any, group) -> list[Any]:
    """Every rank's `mine` (small plain data), in rank order."""
    everyone: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(everyone, mine, group=group)
    return everyone


def max_of(value: float, group, device: torch.device) -> float:
    """The largest of the ranks' `value`s (one all-reduce of one number)."""
    t = torch.tensor([float(value)], dtype=torch.float64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
    return t.item()
