"""Data-parallel training around the batched step: reduce, step, share.

:class:`Replicas` is what an :class:`~rankwise.AugmentedBUG` built with ``process_group=``
holds: at construction every parameter and buffer is broadcast from the group's first rank
(as DDP does) and each low-rank layer gets an owner (:func:`._shard.assign_owners`); before a
step every gradient the step reads is averaged (:meth:`average`; sharded, a layer's factor
gradients go to its owner only); after an augmentation the owners send their layers' results
to every rank (:meth:`share`), and every `check_every`-th truncation the replicas are compared
by a hash computed and gathered on the device (:meth:`check_optimizer`), read with the next
step's exchange (or by :meth:`verify`: a state_dict, a release). The primitives are in
:mod:`._dp` and :mod:`._shard`.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

import torch
from torch import Tensor, nn

from ...linalg import work_dtype
from ...nn._base import AbstractLowRankLayer
from ..functional import all_finite
from . import _dp, _shard
from ._fsdp import is_dtensor


def _all_finite_flag(tensors: list[Tensor], device: torch.device) -> Tensor:
    """A device bool: every tensor finite (max-abs by ``_foreach_norm(inf)``: never overflows)."""
    sharded = [t for t in tensors if is_dtensor(t)]
    if sharded:  # FSDP2's DTensor shards: each rank checks its own (some may be empty), then all agree
        local = [t for t in (t.to_local() for t in sharded) if t.numel()]
        vote = all_finite(local, device).to(torch.float64).reshape(1)
        torch.distributed.all_reduce(vote, op=torch.distributed.ReduceOp.MIN,
                                     group=sharded[0].device_mesh.get_group())
        return vote[0] > 0
    return all_finite(tensors, device)


def core_slot(layer: AbstractLowRankLayer) -> _dp.Slot:
    """A layer's core gradient as a slot to average (two-pass BUG's second evaluation)."""
    S = layer.S
    return _dp.Slot(S.grad, tuple(S.shape), S.dtype, S.device, lambda v, S=S: setattr(S, "grad", v))


class Replicas:
    """One optimizer's data parallelism over `group` (`layers`: its low-rank layers by name;
    `sharded`: each layer integrated by its owner only; `rank_cap`: a layer's largest rank, the
    owners' balance). ``allreduce_bytes``, ``shared_bytes``: what this rank sent in the last step."""

    def __init__(self, model: nn.Module, layers: dict[str, AbstractLowRankLayer], group, *, sharded: bool,
                 rank_cap: Callable[[AbstractLowRankLayer], int]) -> None:
        named = {**dict(model.named_parameters()), **dict(model.named_buffers())}
        _dp.check_shapes(named, group)
        _dp.broadcast_from_first(list(named.values()), group)
        self.group, self.layers = group, layers
        self.rank = torch.distributed.get_rank(group)
        # the owners, sharded or not: they also key the batches, so that both modes batch alike
        self.placement = _shard.assign_owners(
            {n: _shard.integration_cost(m.out_features, m.in_features, rank_cap(m))
             for n, m in layers.items()},
            torch.distributed.get_world_size(group))
        self.owners = self.placement if sharded else None
        self.allreduce_bytes = 0
        self.shared_bytes = 0
        self.pending: _dp.PendingCheck | None = None  # the last replica check, read with the next exchange

    def batch_key(self, name: str) -> int:
        """Layers batched together share this key: the layer's owner (also when replicated, so
        that sharded and replicated runs form the same batches and agree bitwise)."""
        return self.placement[name]

    def grad_slots(self, params: Iterable[Tensor]) -> list[_dp.Slot]:
        """Every gradient a step reads: ``.grad`` of each parameter that requires grad (in
        factor mode a layer's U and V hold G_K (out, r) and G_L (in, r)). Sharded, a factor-mode
        layer's G_K, G_L and S gradient go to its owner only (the others never read them)."""
        roles = {}
        for name, m in self.layers.items():
            if m.grad_mode == "factors":
                roles.update({id(m.U): (name, "K"), id(m.S): (name, "S"), id(m.V): (name, "L")})
        owners = self.owners or {}
        slots = []
        for p in (p for p in params if p.requires_grad):
            name, key = roles.get(id(p), (None, ""))
            # the integrator's gradients are averaged in its working precision (a half-precision
            # sum of finite gradients can overflow), then stored in the parameter's dtype
            dt = p.dtype if name is None else work_dtype(p.dtype)
            slots.append(_dp.Slot(p.grad, tuple(p.shape), dt, p.device,
                                  lambda v, p=p: setattr(p, "grad", None if v is None else v.to(p.dtype)),
                                  owners.get(name), "" if name is None else f"{name}:{key}"))
        return slots

    def average(self, slots: list[_dp.Slot], loss, *, first: bool) -> bool:
        """Average `slots` over the ranks (the step's `first` exchange resets
        :attr:`allreduce_bytes`). Returns whether any rank's loss (sharded, first exchange: or
        its gradients), this rank's included, was not finite, so that every rank skips (or
        raises) together, from the same decision."""
        checked = [] if loss is None else [torch.as_tensor(loss).detach()]
        if first and self.owners is not None:  # only the owners see their layers' gradients: check here
            checked += [s.value for s in slots if s.value is not None]
        device = slots[0].device if slots else torch.device("cpu")
        flag = ~_all_finite_flag(checked, device)  # read with the presence vector, not alone
        pending, self.pending = self.pending, None
        differs = pending.differs() if pending is not None else False
        bad, sent, _, diverged = _dp.average(slots, self.group, flag=flag, also=differs)
        if diverged:  # the previous step's check: raised before this step changes anything
            if pending is not None:
                pending.raise_if_diverged(self.group)
            raise RuntimeError("data-parallel replicas diverged: another rank's last replica check found "
                               "ranks holding different factors (see that rank's error)")
        self.allreduce_bytes = sent + (0 if first else self.allreduce_bytes)
        return bad

    def agree(self, bad: bool, failed: bool, device: torch.device) -> tuple[bool, bool]:
        """Sharded, each rank saw only its own layers: (some rank found a non-finite value, else
        some rank's fixed-width augmentation failed), the same on every rank."""
        code = _shard.max_of(2.0 if bad else float(failed), self.group, device)
        return code == 2, code == 1

    def share(self, names: Iterable[str], state: dict) -> None:
        """Sharded: each owner sends its layers' new factors, buffers and optimizer `state` (τ,
        moments, counters) to every rank; every rank, the owner included, takes the copies
        (bitwise equal values, and one memory layout, so that a checkpoint's bytes agree)."""
        layers = {n: self.layers[n] for n in names}
        mine = {n: {"factors": (m.U, m.S, m.V, m.U_buf, m.V_buf),
                    "state": [state[m.U], state[m.V], state[m.S]]} for n, m in layers.items()}
        device = next(iter(self.layers.values())).S.device
        everyone, self.shared_bytes = _shard.share_from_owners(mine, self.owners, self.group, device)
        for name, v in everyone.items():  # this rank's own layers too: the same layout everywhere
            layer = self.layers[name]
            layer.set_factors(*v["factors"])
            state[layer.U], state[layer.V], state[layer.S] = v["state"]

    def verify(self) -> None:
        """Read the replica check still in flight, if any (``RuntimeError`` naming the ranks that
        differ from the majority): a step's check is otherwise read with the next step's
        gradient exchange. A check that found a difference stays in flight: when this rank alone
        read it (a ``state_dict`` saved on rank 0), the next exchange, where the others report
        it, raises the same error here."""
        if self.pending is not None:
            self.pending.raise_if_diverged(self.group)
            self.pending = None

    def forget(self) -> None:
        """Drop a check in flight (a loaded state replaces what it compared)."""
        self.pending = None

    def check_optimizer(self, opt) -> None:
        """After a truncation: every rank must hold the same ranks, factors, buffers and τ
        (replicated) or, sharded, the same dense parameters (the factors are copies of their
        owner's; the dense parameters are what every rank computes itself)."""
        if self.owners is not None:
            named = {opt._param_names.get(id(p), "?"): (p,) for g in opt.param_groups for p in g["params"]
                     if id(p) not in opt._factor_ids}
        else:
            named = {n: (m.U, m.S, m.V, m.U_buf, m.V_buf,
                         torch.tensor(opt.state[m.S].get("tau", 0.0), dtype=torch.float64))
                     for n, m in self.layers.items()}
        self.verify()  # (none in flight unless two checks come without an exchange between them)
        when = f"at step {opt.param_groups[0]['global_step']}"
        self.pending = _dp.start_check(named, self.group, when=when)
