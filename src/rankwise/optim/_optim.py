"""DLRT and SDLRT as ``torch.optim.Optimizer`` objects.

A thin shell: the step's math is in :mod:`.functional` (pure functions of stacked tensors,
with the kernels of :mod:`._step`) and :mod:`.rules._rules` (update rules and state transport),
run over groups of layers by :mod:`._batched`; this module holds the settings, the param groups,
the layers' gradient modes, the optimizer's state and SDLRT's τ feedback.
"""

from __future__ import annotations

import contextlib
import functools
import math
import warnings
import weakref
from collections.abc import Callable, Iterator

import torch
from torch import Tensor, nn

from ..nn._base import AbstractLowRankLayer, factor_changes, fsdp_classes, layer_of
from . import _batched, _closure, _state
from ._planner import Planner
from ._truncation import strategy
from .parallel import _dp, _fsdp, _shard
from .parallel._replicas import Replicas
from .rules._policies import Budget, Feedback, SeedFeedback, Tolerance, TwoSidedFeedback, _real
from .rules._rules import restart
from .rules._settings import Settings, pop_rule, settings_doc, settings_from


def _split_groups(params: list[Tensor], groups: list[dict] | None, layers: dict[str, AbstractLowRankLayer],
                  names: dict[int, str]) -> list[Tensor] | list[dict]:
    """The optimizer's param groups: `groups` (each a dict with ``params`` and hyperparameters
    that override the defaults, as torch's optimizers take them), then every other parameter
    in a first group with the defaults. A low-rank layer's U, S and V share a group: naming one
    of them places the three."""
    if groups is None:
        return params
    if not isinstance(groups, list | tuple) or not all(isinstance(g, dict) and "params" in g for g in groups):
        raise TypeError("`param_groups` must be a list of dicts, each with 'params' (as torch optimizers "
                        "take param groups)")
    held = {id(p) for p in params}
    trio = {id(t): (m.U, m.S, m.V) for m in layers.values() for t in (m.U, m.S, m.V)}
    placed: dict[int, int] = {}
    out = []
    for i, g in enumerate(groups):
        ps = g["params"]
        ps = [ps] if isinstance(ps, Tensor) else list(ps)
        mine: list[Tensor] = []
        for p in ps:
            if not isinstance(p, Tensor) or id(p) not in held:
                what = names.get(id(p), type(p).__name__) if isinstance(p, Tensor) else type(p).__name__
                raise ValueError(f"`param_groups[{i}]` holds {what!r}, which is not a trainable parameter "
                                 "(or a low-rank factor) of `model`")
            for q in trio.get(id(p), (p,)):
                if placed.get(id(q), i) != i:
                    raise ValueError(f"parameter {names.get(id(q), '?')!r} is in "
                                     f"`param_groups[{placed[id(q)]}]` and `param_groups[{i}]` "
                                     "(a low-rank layer's U, S and V share a group)")
                if id(q) not in placed:
                    placed[id(q)] = i
                    mine.append(q)
        out.append({**g, "params": mine})
    return [{"params": [p for p in params if id(p) not in placed]}, *out]


def _check_group(group: dict, settings: Settings, layers: dict[str, AbstractLowRankLayer]) -> None:
    """A param group's ``lr`` and rule hyperparameters, checked as the constructor checks them."""
    if "lr" in group and not (math.isfinite(v := _real("lr", group["lr"], finite=False)) and v >= 0):
        raise ValueError(f"a param group's `lr` must be a finite number >= 0; got {group['lr']}")
    rule = settings.rule
    given = {k: group[k] for k in rule.hyper() if k in group}
    if given:
        type(rule)(**given)  # validates, with the constructor's messages
    unknown = {"momentum", "betas", "eps", "decoupled_weight_decay"} - set(rule.hyper())
    if wrong := sorted(k for k in unknown if k in group):
        raise ValueError(f"a param group sets {wrong} but the rule is {type(rule).__name__} "
                         f"(its hyperparameters: {sorted(rule.hyper())})")


_FEEDBACK = {True: SeedFeedback, "seed": SeedFeedback, "two-sided": TwoSidedFeedback}
IMPLEMENTATIONS = ("batched", "exact")


def _checked(model: nn.Module, lr: float, settings: Settings | None, kwargs: dict, process_group) -> Settings:
    """The constructor's arguments checked (one line each); the settings, from `kwargs` if not given."""
    if not isinstance(model, nn.Module):
        what = "model.parameters()" if isinstance(model, Iterator) else type(model).__name__
        raise TypeError(f"`model` must be an nn.Module (the model itself, not {what}): the optimizer "
                        "finds its low-rank layers in it")
    if not isinstance(model, _ddp_class()):
        _check_unwrapped(model)
    if not (math.isfinite(v := _real("lr", lr, finite=False)) and v >= 0):
        raise ValueError(f"`lr` must be a finite number >= 0; got {lr}")
    if settings is None:
        settings = settings_from(kwargs)
    elif kwargs:
        raise TypeError(f"give `settings` or the settings as keyword arguments, not both "
                        f"(got {sorted(kwargs)})")
    elif not isinstance(settings, Settings):
        raise TypeError(f"`settings` must be rankwise.Settings; got {type(settings).__name__}")
    if process_group is not None and not torch.distributed.is_initialized():
        raise ValueError("`process_group` given but torch.distributed is not initialised: call "
                         "rankwise.dist.init_process_group() (under torchrun) first")
    if process_group is not None:
        _dp.check_model(model)
    return settings


def _check_fsdp(model: nn.Module, settings: Settings, process_group) -> bool:
    """Is `model` sharded by FSDP2 (``fully_shard``) in a form the step can train? Its low-rank
    layers must be at a fixed capacity (FSDP2 shards each parameter once, when it wraps it), the
    steps single-pass and augmenting every time (U's and V's gradients in every backward); refused
    by name otherwise, and FSDP1 and ``process_group=`` with it."""
    fsdp = fsdp_classes()
    wrapped = next((n for n, m in model.named_modules() if fsdp and isinstance(m, fsdp)), None)
    if wrapped is None:
        return False
    where = repr(wrapped or "<root>")
    if type(model.get_submodule(wrapped)).__name__.startswith("FullyShardedDataParallel"):
        raise ValueError(f"DLRT/SDLRT does not support FSDP1 (module {where}): shard with FSDP2's "
                         "torch.distributed.fsdp.fully_shard over fixed-capacity factors instead")
    if process_group is not None:
        raise ValueError("give an FSDP2-sharded model or `process_group`, not both: FSDP2 already averages "
                         "the gradients")
    loose = next((n for n, m in model.named_modules()
                  if isinstance(m, AbstractLowRankLayer) and m.capacity is None), None)
    if loose is not None:
        raise ValueError("DLRT/SDLRT under fully_shard (FSDP2) needs fixed-capacity factors: layer "
                         f"{loose!r} has none; convert with rankwise.to_low_rank(model, ..., "
                         "capacity='auto') before fully_shard")
    if settings.update_every > 1 or not settings.single_pass:
        what = "update_every > 1" if settings.update_every > 1 else "two-pass BUG (single_pass=False)"
        raise ValueError(f"{what} is not supported under fully_shard (FSDP2) yet: train with update_every=1 "
                         "and single_pass=True, or with DDP")
    return True


def _ddp_class() -> type:
    from torch.nn.parallel import DistributedDataParallel

    return DistributedDataParallel


def _unwrap_ddp(model: nn.Module, settings: Settings, process_group) -> tuple[nn.Module, nn.Module | None]:
    """(the model to train, its DistributedDataParallel wrapper or None). Under DDP the factors
    must be at a fixed capacity (DDP's buckets are fixed when it wraps the model; the ranks
    change) and the wrapper must let parameters go unused where a step leaves U and V out
    (``update_every`` > 1, two-pass BUG): refused by name otherwise."""
    if not isinstance(model, _ddp_class()):
        return model, None
    inner = model.module  # (with `process_group` too, _checked has refused the wrapper)
    _check_unwrapped(inner)
    loose = next((n for n, m in inner.named_modules()
                  if isinstance(m, AbstractLowRankLayer) and m.capacity is None), None)
    if loose is not None:
        raise ValueError(f"DLRT/SDLRT under DistributedDataParallel needs fixed-capacity factors (DDP's "
                         f"buckets are fixed when it wraps the model, and the ranks change): layer {loose!r} "
                         "has none; "
                         "convert with rankwise.to_low_rank(model, ..., capacity='auto') (or an int) before "
                         "wrapping the model in DDP")
    partial = settings.update_every > 1 or not settings.single_pass
    if partial and not model.find_unused_parameters:
        what = "update_every > 1" if settings.update_every > 1 else "two-pass BUG (single_pass=False)"
        raise ValueError(f"{what} leaves U and V without gradients in some backward passes: wrap the model "
                         "with DistributedDataParallel(model, find_unused_parameters=True)")
    for m in inner.modules():  # (DDP broadcast rank 0's parameters and buffers when it wrapped the model)
        if isinstance(m, AbstractLowRankLayer):
            m.sync_live()
    return inner, model


class AugmentedBUG(torch.optim.Optimizer):
    r"""The rank-adaptive augmented basis-update & Galerkin integrator as an optimizer, with its
    choices passed as policies (:mod:`._policies`); :class:`DLRT` and :class:`SDLRT` are presets.
    A thin shell: it collects each group of layers, calls the step (:mod:`.functional`, through
    :mod:`._batched`) and writes the results back.

    Per low-rank layer and augmentation step: K- and L-updates from the gradients of K = US and
    L = VSᵀ, ``Ū = orth[U0, ΔK(, U_buf)]``, ``V̄ = orth[V0, ΔL(, V_buf)]``, the Galerkin core
    ``S̄ = ŪᵀU0 S0 V0ᵀV̄ + ΔS̄``, its SVD and a truncation chosen by `truncation`. The optimizer
    holds every parameter of the model, as ``torch.optim.Adam(model.parameters())`` does: a step
    updates those with a gradient, so frozen ones (a PEFT base model, a frozen low-rank layer)
    stay as they are and train once unfrozen. While it trains a low-rank layer, the layer's
    ``U.grad`` and ``V.grad`` hold the factor gradients G_K, G_L: another optimizer that steps U or
    V in the meantime is refused at the layer's next forward with gradients or this optimizer's
    next ``step()`` (:meth:`release` hands the layers back to plain torch first). A dense
    parameter given to a second optimizer as well moves twice per step, as with two torch
    optimizers: give it its own hyperparameters with `param_groups` instead.

    **Arguments:** `model`, `lr`, `param_groups`, `process_group` as under :class:`DLRT`;
    `implementation`: ``"batched"`` (default: layers of one shape and rank bucket together,
    padded to one rank, room for a fixed number of new directions) or ``"exact"`` (groups of one
    rank, room for every direction), the same results to roundoff, as torch's ``foreach=``; and
    the settings, as one :class:`Settings` (`settings`) or as its fields by keyword (the
    presets' ``optimizer=``, ``momentum=``, ... instead of `rule`):
    """

    def __init__(self, model: nn.Module, lr: float, settings: Settings | None = None, *,
                 process_group=None, param_groups: list[dict] | None = None,
                 implementation: str = "batched", **kwargs) -> None:
        if implementation not in IMPLEMENTATIONS:
            raise ValueError(f"`implementation` must be one of {IMPLEMENTATIONS}; got {implementation!r}")
        self.implementation = implementation
        settings = _checked(model, lr, settings, kwargs, process_group)
        model, ddp = _unwrap_ddp(model, settings, process_group)
        self.ddp = ddp  # averages every .grad (G_K, G_S, G_L in factor mode) during the backward
        self.fsdp = _check_fsdp(model, settings, process_group)  # FSDP2: the step on gathered layers
        self.settings = settings
        self.strategy = strategy(settings)  # how the step chooses ranks (:mod:`._truncation`)
        self.process_group = process_group
        self._model = weakref.ref(model)
        self._token = object()  # the layers' mark that this optimizer trains them (release, finalizer)
        self._released = False
        self._warned_world = False
        self._group_by_id: dict[int, dict] | None = None
        self._skipped: Tensor | None = None  # core steps skipped on the device since the last augmentation
        self._fills: dict = {}  # the step's fill directions, drawn once per shape (:func:`._step._fill`)
        self._seen_changes = factor_changes()
        # every low-rank layer, frozen ones too: as torch.optim.Adam(model.parameters()) holds frozen
        # parameters and trains them once they are unfrozen and get gradients (gradual unfreezing)
        self.layers: dict[str, AbstractLowRankLayer] = {
            n: m for n, m in model.named_modules() if isinstance(m, AbstractLowRankLayer)
        }
        if not self.layers:
            warnings.warn("no low-rank layers in `model`; every parameter is updated densely "
                          "(use rankwise.to_low_rank first)", stacklevel=3)
        # the settings as plain data: load_state_dict warns on a state saved under other policies
        defaults = dict(lr=lr, **settings.rule.hyper(), global_step=0, settings=settings.to_dict())
        self.planner: Planner | None = None  # a Budget's bookkeeping
        if settings.budgeted:
            self.planner = Planner(model, self.layers, settings, self._rank_cap)
            # where the schedule starts is history, not derivable from a later model: it lives
            # in the param group, so it is saved and restored with the optimizer's state_dict
            defaults["budget_start"] = self.planner.start()
        self._factor_ids = {id(p) for m in self.layers.values() for p in (m.U, m.S, m.V)}
        self._param_names = {id(p): n for n, p in model.named_parameters()}
        # every parameter, frozen ones too (a step skips those without a gradient, as torch's do)
        params = list(model.parameters())
        super().__init__(_split_groups(params, param_groups, self.layers, self._param_names), defaults)
        for layer in self.layers.values():
            self._adopt(layer)
        if self.layers and all(m.capacity is not None for m in self.layers.values()):
            _state.materialise(self)  # (a fresh state_dict() has every key and shape: DCP loads into it)
        self._set_modes()
        # dropped without release(): the layers go back to plain autograd, as release() does
        self._owned = list(self.layers.values())  # (add_param_group appends to it)
        weakref.finalize(self, _release, self._owned, self._token)
        self.dp: Replicas | None = None  # data parallel: reduce, step, share (:mod:`._replicas`)
        if process_group is not None:
            self.dp = Replicas(model, self.layers, process_group, sharded=settings.data_parallel == "sharded",
                               rank_cap=self._rank_cap)
        self._versions = _versions(self)  # (what this optimizer left; step() checks them)

    def _adopt(self, layer: AbstractLowRankLayer) -> None:
        """Start a layer's optimizer state and mark it as trained by this optimizer."""
        for p in (layer.U, layer.V):  # (their rule states: K's under U, L's under V; made here, so
            self.state[p]             # that every rank of a data-parallel run orders them alike)
        self.state[layer.S]["r_init"] = layer.rank
        if self.settings.buffer:
            layer.reserve_buffer()  # (fixed capacity: the buffer's shape fixed from now on)
        if not self.settings.budgeted:  # a budget has no τ (its state would give a tolerance optimizer τ = 0)
            self.state[layer.S]["tau"] = self.settings.tau
        if getattr(layer, "_grad_owner", None) is None and layer.S.requires_grad:  # what release() gives back
            layer._requires_grad = (layer.U.requires_grad, layer.V.requires_grad)
        layer._grad_owner = self._token

    # what a pickled optimizer carries beside torch's defaults, state and param groups
    _PICKLED = ("implementation", "settings", "strategy", "process_group", "_released", "_warned_world",
                "layers", "planner", "_owned", "ddp", "fsdp")

    def __getstate__(self) -> dict:
        """Pickled (``torch.save({"model": model, "opt": opt})``, ``copy.deepcopy``) with its model,
        as a torch optimizer is with its parameters; a data-parallel one is refused."""
        if self.dp is not None:
            raise TypeError(f"a data-parallel {type(self).__name__} (process_group=…) cannot be pickled: "
                            "save opt.state_dict() (and model.state_dict()) and build the optimizer again on "
                            "each rank")
        model = self._model()
        if model is None:
            raise TypeError(f"this {type(self).__name__}'s model was garbage-collected: nothing to pickle")
        return {**super().__getstate__(), **{k: self.__dict__[k] for k in self._PICKLED}, "_model": model}

    def __setstate__(self, state: dict) -> None:
        """The unpickled optimizer trains the unpickled model's layers, as it did before.
        (torch's ``load_state_dict`` calls this too, with the state and param groups alone.)"""
        if "_model" not in state:
            super().__setstate__(state)
            return
        model = state.pop("_model")
        super().__setstate__(state)
        self._model, self._token, self.dp = weakref.ref(model), object(), None
        self._group_by_id, self._skipped, self._fills = None, None, {}
        self._factor_ids = {id(p) for m in self.layers.values() for p in (m.U, m.S, m.V)}
        self._param_names = {id(p): n for n, p in model.named_parameters()}
        if not self._released:
            for layer in self.layers.values():
                layer._grad_owner = self._token
            self._set_modes()
        weakref.finalize(self, _release, self._owned, self._token)
        self._seen_changes = factor_changes()
        self._versions = _versions(self)

    def release(self) -> None:
        """Hand the low-rank layers back to plain torch: they return to ``"full"`` gradient mode
        (U, S and V get their true gradients, all require grad, the factor gradients G_K, G_L
        are dropped), so that a torch optimizer built afterwards (``AdamW(model.parameters())``)
        trains every factor (U's and V's ``requires_grad`` as they were before this optimizer).
        This optimizer takes no further step. Dropping the optimizer does the same once Python
        collects it."""
        _release(self._owned, self._token)
        self._released = True
        if self.dp is not None:
            self.dp.verify()

    def state_dict(self) -> dict:
        """As ``torch.optim.Optimizer.state_dict``; with a `process_group`, the last replica check
        is read first, so that a replica that drifted is never saved (``RuntimeError``)."""
        if self.dp is not None:
            self.dp.verify()
        return super().state_dict()

    def owners(self) -> dict[str, int] | None:
        """Sharded data parallelism: {layer name: the rank of `process_group` that integrates
        it} (balanced by the integrator's cost at each layer's largest rank; the same on every
        rank and after a restart); ``None`` otherwise."""
        return None if self.dp is None or self.dp.owners is None else dict(self.dp.owners)

    @property
    def allreduce_bytes(self) -> int:
        """Data parallel: the bytes this rank all-reduced in the last step (0 otherwise)."""
        return 0 if self.dp is None else self.dp.allreduce_bytes

    @property
    def shared_bytes(self) -> int:
        """Sharded: the bytes of new factors and state this rank sent in the last step."""
        return 0 if self.dp is None else self.dp.shared_bytes

    @property
    def truncation(self) -> Tolerance | Budget:
        return self.settings.truncation

    @property
    def feedback(self) -> Feedback | None:
        return self.settings.feedback

    @property
    def rule(self):
        """The update rule's function ``(grad, param, state, hyper) -> (delta, state)``."""
        return self.settings.rule.update

    # ----------------------------------------------------------------- public queries
    def ranks(self) -> dict[str, int]:
        """{layer name: current rank}."""
        return {n: m.rank for n, m in self.layers.items()}

    def taus(self) -> dict[str, float]:
        """{layer name: current truncation tolerance τ} (SDLRT's feedback lowers it); with a
        :class:`Budget`, the relative tail ‖σ_discarded‖/‖σ‖ of each layer's last truncation
        (the τ that would have given its rank; 0 before the first)."""
        key = "tail" if self.settings.budgeted else "tau"
        return {n: self.state[m.S].get(key, 0.0) for n, m in self.layers.items()}

    def budget(self) -> dict[str, float] | None:
        """With a `target`: the parameter budget now and at the end (``budget_params``,
        ``target_params``; U, S, V of every low-rank layer plus all other parameters), the
        parameters stored now (``stored_params``) and the compression they give
        (``compression``, as :func:`rankwise.compression`'s ratio); ``None`` without a target."""
        return None if self.planner is None else self.planner.report(self._augmentation(),
                                                                       self._hp()["budget_start"])

    def _augmentation(self) -> int:
        return self._hp()["global_step"] // self.settings.update_every

    def _augment_now(self) -> bool:
        return self.param_groups[0]["global_step"] % self.settings.update_every == 0

    def _set_modes(self) -> None:
        """The layers this optimizer trains (not released, not taken over by another) into the
        gradient mode of the next step."""
        mode = "factors" if self._augment_now() else "core"
        for layer in self.layers.values():
            if getattr(layer, "_grad_owner", None) is self._token:
                layer.set_grad_mode(mode)

    def _trained(self) -> dict[str, AbstractLowRankLayer]:
        """The layers this optimizer trains now (not released, not taken over by another)."""
        if self._released:
            return {}
        return {n: m for n, m in self.layers.items() if getattr(m, "_grad_owner", None) is self._token}

    def _hp(self) -> dict:
        """The first param group: the optimizer's own counters (``global_step``,
        ``budget_start``) live there."""
        return self.param_groups[0]

    def _hp_of(self, p: Tensor) -> dict:
        """The hyperparameters of the param group holding `p` (a layer's: those of its S)."""
        groups = self._group_by_id
        if groups is None or id(p) not in groups:
            groups = self._group_by_id = {id(q): g for g in self.param_groups for q in g["params"]}
        return groups[id(p)]

    def _core_hp(self, S: Tensor) -> dict:
        """The hyperparameters of the core's rule: its group's, the rate times `core_lr_ratio`."""
        hp, ratio = self._hp_of(S), self.settings.core_lr_ratio
        return hp if ratio == 1 else {**hp, "lr": hp["lr"] * ratio}

    def add_param_group(self, param_group: dict) -> None:
        """As ``torch.optim.Optimizer.add_param_group`` (a layer's U, S and V go together), with
        the group's ``lr`` and rule hyperparameters checked. A low-rank layer new to this
        optimizer (its U, S or V in the group) is integrated from the next step, as the layers
        found at construction are (under a tolerance, on one process; a :class:`Budget` or
        `process_group` plans for the layers it was built with, and refuses)."""
        new: list[AbstractLowRankLayer] = []
        if hasattr(self, "settings"):  # torch's __init__ adds the first groups before we are set up
            _check_group(param_group, self.settings, self.layers)
            param_group, new = _with_new_layers(self, param_group)
        super().add_param_group(param_group)
        if len(self.param_groups) > 1:  # the optimizer's counters live in the first group only
            for key in ("global_step", "budget_start"):
                self.param_groups[-1].pop(key, None)
        self._group_by_id = None
        for layer in new:
            model = self._model()
            names = {id(m): n for n, m in model.named_modules()} if model is not None else {}
            name = names.get(id(layer)) or f"<added {len(self.layers)}>"
            self.layers[name] = layer
            self._factor_ids.update(id(p) for p in (layer.U, layer.S, layer.V))
            for key, p in layer.named_parameters():
                self._param_names.setdefault(id(p), f"{name}.{key}")
            self._adopt(layer)
            self._owned.append(layer)
        if new:
            self._set_modes()
            self._versions = _versions(self)

    @torch.no_grad()
    def step(self, closure: Callable[[], Tensor] | None = None) -> Tensor | None:
        """One training step. ``closure`` zeroes grads, runs forward and backward and returns
        the loss; it is called once (single pass) or twice (``single_pass=False``). Without a
        closure the gradients of the last ``backward()`` are used (single pass only).

        Raises (before any weight or optimizer state is changed):

        - ``TypeError`` if the closure returns ``None``: it must return the loss, as the
          closures of torch optimizers do.
        - ``RuntimeError`` if there is no gradient at all: no ``.grad`` on any parameter and
          no factor gradient G_K/G_L in any low-rank layer, i.e. the closure (or, without a
          closure, the caller) did not call ``backward()``. Unlike ``torch.optim.SGD``, which
          silently does nothing in that case, this also holds for ``step()`` without a
          closure: nothing can be learnt from such a step, so it is almost surely a bug.
          Layers unused by a forward pass having no gradient is fine. Gradients that are zero
          tensors (``zero_grad(set_to_none=False)``) count as gradients.
        """
        if self._released:
            raise RuntimeError(f"this {type(self).__name__} was released (release()): its layers are back in "
                               "plain autograd mode; build a new optimizer to train them again")
        if not self._warned_world and self.dp is None and self.ddp is None and not self.fsdp:
            self._warned_world = True
            _closure.warn_without_group(self)
        if factor_changes() != self._seen_changes:  # someone else replaced factors since our last step
            _restart_stale_moments(self)
        elif not self.fsdp:
            _refuse_foreign_writes(self)
        augment = self._augment_now()
        two_pass = augment and not self.settings.single_pass and self.layers
        if closure is None and two_pass:
            raise ValueError("two-pass DLRT (`single_pass=False`) needs `step(closure)`")
        try:
            loss = _closure.evaluate(self, closure)
            if not _closure.has_grads(self):
                if (model := self._model()) is not None:  # sharded after construction: its parameters are new
                    _check_unwrapped(model, after=True)
                raise RuntimeError(_closure.no_grad_message(type(self).__name__, closure))
            if not _closure.amp_unscale(self):
                return loss  # torch.amp.GradScaler found inf/NaN: skip, as torch optimizers do
            dp = self.dp is not None
            if dp and self.dp.average(self.dp.grad_slots(p for g in self.param_groups for p in g["params"]),
                                      loss, first=True):
                ok = self._nonfinite("non-finite loss or gradient on a data-parallel rank")
            elif augment:
                with self._placement():
                    ok = _batched.augmenting_step(self, loss, closure if two_pass else None)
                if ok:
                    _batched.dense_step(self)
            else:
                with self._placement():
                    ok = _batched.core_step(self, loss)
            if ok:
                self._hp()["global_step"] += 1
                every = self.settings.check_every
                if augment and dp and every and self._augmentation() % every == 0:
                    self.dp.check_optimizer(self)
        finally:
            for layer in self.layers.values():
                layer.reset_factor_grads()
            self._set_modes()
            self._seen_changes = factor_changes()
            self._versions = _versions(self)
        return loss

    def _placement(self):
        """Where the step's layers live: FSDP2-sharded layers gathered whole for the step
        (:func:`._fsdp.gathered`); otherwise the layers themselves."""
        return _fsdp.gathered(self) if self.fsdp else contextlib.nullcontext()

    _step_supports_amp_scaling = True  # torch.amp.GradScaler (:func:`._closure.amp_unscale`)

    def load_state_dict(self, state_dict: dict) -> None:
        """As ``torch.optim.Optimizer.load_state_dict``, with a state saved at other ranks refused
        and one saved under other policies warned about (:mod:`._state`); the layers' gradient
        modes then follow the loaded step count."""
        start = self._hp().get("budget_start")
        _state.warn_other_policies(self.settings, state_dict)
        _state.refuse_nested(self.layers, self.param_groups, state_dict)
        _state.check_saved_ranks(self.layers, self.param_groups, state_dict)
        super().load_state_dict(state_dict)
        if self.dp is not None:
            self.dp.forget()
        self._group_by_id = None
        _state.tidy(self, start)
        self._set_modes()
        self._versions = _versions(self)

    def _nonfinite(self, what: str) -> bool:
        """Apply the `on_nonfinite` policy: raise, or warn and report the step as skipped."""
        msg = what + "; no weights were changed"
        if self.settings.on_nonfinite == "raise":
            raise FloatingPointError(msg + "; pass on_nonfinite='skip' to skip such steps")
        warnings.warn(msg + "; step skipped", RuntimeWarning, stacklevel=3)
        return False

    @property
    def _rank_cap(self) -> Callable[[AbstractLowRankLayer], int]:
        """A layer's largest rank under the settings (a function holding no reference to this
        optimizer: kept by the planner and the replicas, it must not make a reference cycle, so
        that a dropped optimizer releases its layers at once)."""
        return functools.partial(_rank_cap, self.settings.max_rank)

    def _budget_ranks(self, spectra: dict[str, Tensor],
                      scores: dict[str, list[float]] | None = None) -> dict[str, int]:
        """Every layer's rank planned in this step under the budget (:meth:`Planner.ranks`).
        Sharded, the spectra (and sensitivity scores) of every owner's layers are gathered
        first, and every rank allocates, identically."""
        if self.dp is not None and self.dp.owners is not None:  # every owner's spectra and scores
            mine = {n: (s.cpu(), None if scores is None else scores[n]) for n, s in spectra.items()}
            spectra, gathered = {}, {}
            for theirs in _shard.gather_objects(mine, self.dp.group):
                for n, (s, sc) in theirs.items():
                    spectra[n], gathered[n] = s, sc
            spectra = {n: spectra[n] for n in self.layers if n in spectra}  # in the model's order
            if self.truncation.data_aware:
                scores = {n: gathered[n] for n in spectra}
        return self.planner.ranks(spectra, scores, self._augmentation(), self._hp()["budget_start"])


def _restart_stale_moments(opt: AugmentedBUG) -> None:
    """A layer whose rule moments no longer have its factors' shapes (the model's state was
    loaded at other ranks without the optimizer's, or ``set_factors`` changed its rank) restarts
    them, with one warning naming the layers. A torch optimizer keeps its moments through such a
    load; these are coordinates in bases the layer no longer has, so they cannot be kept."""
    stale = []
    for name, layer in opt.layers.items():
        trio = (layer.U, layer.S, layer.V)
        held = layer.factors() if layer.capacity is None else trio  # (the moments' shapes)
        if any(torch.is_tensor(m := opt.state[p].get(k)) and m.shape != live.shape
               for p, live in zip(trio, held, strict=True) for k in ("m", "v")):
            for p in trio:
                opt.state[p] = restart(restart(opt.state[p], "m"), "v")
            stale.append(name)
    if stale:
        warnings.warn(f"{type(opt).__name__}: the ranks of {', '.join(map(repr, stale))} changed outside the "
                      "optimizer (a model state loaded without the optimizer's, or set_factors); their "
                      "moments restart (load the optimizer's state saved with the model to keep them)",
                      stacklevel=5)


def _with_new_layers(opt: AugmentedBUG, group: dict) -> tuple[dict, list[AbstractLowRankLayer]]:
    """The group with the U, S and V of every low-rank layer it touches (the three go
    together), and the layers new to this optimizer."""
    ps = group["params"]
    ps = [ps] if isinstance(ps, Tensor) else list(ps)
    new: dict[int, AbstractLowRankLayer] = {}
    for p in ps:
        layer = layer_of(p) if isinstance(p, Tensor) else None
        if layer is not None and id(p) not in opt._factor_ids:
            new[id(layer)] = layer
    if new and (opt.settings.budgeted or opt.process_group is not None):
        raise ValueError("add_param_group with a new low-rank layer: the optimizer plans a budget "
                         "(`target`) or data-parallel owners for the layers it was built with; add the "
                         "layer to the model first, then build the optimizer")
    have = {id(p) for p in ps}
    for layer in new.values():
        ps += [t for t in (layer.U, layer.S, layer.V) if id(t) not in have]
    return {**group, "params": ps}, list(new.values())


def _release(layers: list[AbstractLowRankLayer], token: object) -> None:
    """The layers still marked with `token` go back to plain autograd (``"full"`` mode)."""
    for layer in layers:
        if getattr(layer, "_grad_owner", None) is token:
            layer.set_grad_mode("full")
            layer._grad_owner = None
            if layer.S.requires_grad:  # (a frozen layer stays frozen)
                u, v = getattr(layer, "_requires_grad", (True, True))  # as they were before
                layer.U.requires_grad_(u)
                layer.V.requires_grad_(v)


def _check_unwrapped(model: nn.Module, after: bool = False) -> None:
    """Refuse data-parallel wrappers the integrator cannot train through (one line each);
    `after`: the model was wrapped after the optimizer was built."""
    from torch.nn.parallel import DistributedDataParallel

    if isinstance(model, DistributedDataParallel):
        raise ValueError("DLRT/SDLRT cannot train a DistributedDataParallel-wrapped model: DDP averages "
                         "only .grad in buckets fixed at construction, and the ranks change; pass the model "
                         "itself with process_group=torch.distributed.group.WORLD (the optimizer averages "
                         "every gradient it reads)")
    fsdp = fsdp_classes()
    wrapped = next((n for n, m in model.named_modules() if fsdp and isinstance(m, fsdp)), None)
    if wrapped is not None and after:
        raise ValueError(f"module {wrapped or '<root>'!r} was sharded by fully_shard after the optimizer was "
                         "built (its parameters are new ones): call fully_shard first, then build DLRT/SDLRT")


def _rank_cap(cap: int | None, layer: AbstractLowRankLayer) -> int:
    return layer.max_rank if cap is None else min(cap, layer.max_rank)


def _versions(opt: AugmentedBUG) -> dict[str, tuple[int, int]]:
    """The version counters of the U and V of each layer `opt` trains (bumped by every in-place
    write), also marked on the layers (:meth:`~rankwise.AbstractLowRankLayer.mark_stepped`: a
    forward checks them)."""
    layers = opt._trained()
    for m in layers.values():
        m.mark_stepped(type(opt).__name__)
    return {n: (m.U._version, m.V._version) for n, m in layers.items()}


def _refuse_foreign_writes(opt: AugmentedBUG) -> None:
    """A layer this optimizer trains whose U or V was written in place since its last step (not by
    ``set_factors`` or ``load_state_dict``, which :func:`factor_changes` counts) was most likely
    stepped by another optimizer with the factor gradients G_K, G_L in U.grad, V.grad: refused before
    this step changes anything. A fixed-capacity layer whose live rank no longer matches its tensors
    is left to the step's own check (its tensors were loaded in place)."""
    for name, layer in opt._trained().items():
        now = (layer.U._version, layer.V._version)
        if opt._versions.get(name, now) == now:
            continue
        if layer.capacity is not None and tuple(int(v) for v in layer.live.tolist()) != tuple(layer._live):
            continue
        kind = type(opt).__name__
        raise RuntimeError(
            f"{kind}.step(): the U or V of layer {name!r} ({type(layer).__name__}) changed since this "
            f"{kind}'s last step, and not by set_factors or load_state_dict: another optimizer stepped it? "
            f"While a {kind} trains a layer, its U.grad and V.grad hold the factor gradients G_K, G_L "
            f"(not dL/dU, dL/dV), so that step was wrong; call release() on this {kind} before training "
            "the layer with another optimizer (no weight was changed by this step). To write factors "
            "yourself (an EMA swapped in for evaluation), use load_state_dict or set_factors, which "
            "the optimizer follows")


_COMMON_DOC = """
    **Arguments:**
    - `model`: a module containing :class:`LowRankLinear` / :class:`LowRankConv2d` layers (see
      :func:`to_low_rank`). Every other parameter (biases, norms, dense layers) is updated by
      the same rule in the same ``step``.
    - `lr`: learning rate, finite and >= 0 (the first param group's ``lr``, so LR schedulers work).
    - `param_groups`: optional groups with their own hyperparameters, as torch optimizers take
      them (``[{"params": head.parameters(), "lr": 1e-3, "weight_decay": 0.0}]``); every other
      parameter forms the first group, with `lr` and the rule's values. A low-rank layer's U, S
      and V share a group (naming one places the three). Each group's ``lr`` and rule
      hyperparameters apply to its parameters, also after ``add_param_group``.
    - `tau`: relative truncation tolerance τ in [0, 1): the discarded tail satisfies
      ‖Σ_tail‖_F ≤ τ‖S̄‖_F. Give `tau` or `target`.
    - `target`: instead of τ, the compression to reach (``rankwise.compression(model)["ratio"]``,
      e.g. 0.9 keeps 10 % of the dense parameters, counting every parameter of the model).
      At each augmentation the ranks are allocated model-wide: greedily, the singular
      direction that removes the most relative error of its layer per √(parameters it costs),
      until the budget is spent (``rankwise.nn._budget.allocate_ranks``; `allocation`
      chooses another rule: ``"error"``, ``"energy"``, ``"uniform"``). The budget falls
      from the model's size at construction to the target over `ramp_steps` (default 200) augmentations
      (cubically, AdaLoRA's schedule: fast while the spectra still hold much small energy),
      then stays there. ``taus()`` then reports each layer's relative discarded tail, and
      ``budget()`` the budget and the compression reached. SDLRT's τ feedback does not apply.
    - `momentum`: SGD momentum μ in [0, 1) (``torch.optim.SGD`` accepts μ >= 1, but then the
      buffer m ← μm + g never decays and training diverges, so it is rejected here).
    - `weight_decay`: weight decay >= 0 (on W for low-rank layers): L2 (added to the gradient) for
      ``"sgd"`` and ``"adam"``, decoupled (``p ← p − lr·wd·p``, as ``torch.optim.AdamW``) for
      ``"adamw"`` or with ``decoupled_weight_decay=True``; default 0 (1e-2 for ``"adamw"``, as torch).
    - `optimizer`: ``"sgd"``, ``"adam"`` or ``"adamw"`` (with `betas`, each in [0, 1), and `eps` > 0),
      applied to K, L, S and the dense parameters; its state is rotated into new bases after
      every truncation.
""" + settings_doc(("single_pass", "min_rank", "max_rank", "adaptive", "update_every", "on_nonfinite",
                     "moments", "core_lr_ratio")) + """
    - `process_group`: data-parallel training (e.g. ``torch.distributed.group.WORLD`` after
      :func:`rankwise.dist.init_process_group`, each rank on its own shard of every batch; do
      not also wrap the model in DDP). At construction every parameter and buffer is
      broadcast from the group's first rank; every gradient the step reads is averaged
      (sharded: a layer's factor gradients go to its owner, :meth:`owners`); a non-finite loss
      or gradient on any rank skips (or raises) on all.
""" + settings_doc(("data_parallel", "check_every")) + """
"""


def _refuse(name: str, kwargs: dict, keys: tuple[str, ...]) -> None:
    """A preset sets these itself: refuse them as Python refuses an unknown keyword."""
    for k in keys:
        if k in kwargs:
            raise TypeError(f"{name}() got an unexpected keyword argument {k!r} (it sets {k} itself; "
                            "use rankwise.AugmentedBUG to choose it)")


def _truncation(tau: float | None, target: float | None, ramp_steps: int | None,
                allocation: str | None) -> Tolerance | Budget:
    """The presets' `tau` / `target` as a truncation policy (`ramp_steps` and `allocation` only
    with a target: with τ they would do nothing)."""
    if target is None and tau is not None and (ramp_steps is not None or allocation is not None):
        given = ", ".join(k for k, v in (("ramp_steps", ramp_steps), ("allocation", allocation))
                          if v is not None)
        raise ValueError(f"{given} apply to a compression target (`target=`), not to `tau`: with a tolerance "
                         "each layer's rank follows its own spectrum; leave them out or give target=")
    ramp_steps = 200 if ramp_steps is None else ramp_steps
    allocation = "error-sqrt" if allocation is None else allocation
    if tau is None and target is None:
        raise ValueError("give `tau` (a relative truncation tolerance, e.g. tau=0.1) or `target` "
                         "(the compression to reach, e.g. target=0.9)")
    if tau is not None and target is not None:
        raise ValueError(f"give `tau` or `target`, not both (got tau={tau}, target={target}): with a "
                         "target the budget chooses every layer's rank")
    return Tolerance(tau) if target is None else Budget(target, ramp_steps, allocation)


AugmentedBUG.__doc__ = AugmentedBUG.__doc__.rstrip() + "\n" + settings_doc() + """

    Example: ``AugmentedBUG(model, 0.05, truncation=Budget(0.9, ramp_steps=300), buffer=True,
    rule=SGD(momentum=0.9))``.
"""


class DLRT(AugmentedBUG):
    r"""Rank-adaptive dynamical low-rank training: the augmented basis-update & Galerkin
    integrator as an optimizer (:class:`AugmentedBUG` with a :class:`Tolerance` or a
    :class:`Budget`, no buffer, no feedback).

    Per low-rank layer and augmentation step: K- and L-updates from the gradients of
    K = US and L = VSᵀ, ``Ū = orth[U0, ΔK]``, ``V̄ = orth[V0, ΔL]``, Galerkin core
    ``S̄ = ŪᵀU0 S0 V0ᵀV̄ + ΔS̄``, SVD of S̄ and truncation at ϑ = τ‖S̄‖_F.
    """

    def __init__(self, model: nn.Module, lr: float, *, tau: float | None = None,
                 target: float | None = None, ramp_steps: int | None = None, allocation: str | None = None,
                 process_group=None, **settings) -> None:
        _refuse(type(self).__name__, settings, ("truncation", "feedback", "buffer"))
        super().__init__(model, lr, truncation=_truncation(tau, target, ramp_steps, allocation),
                         process_group=process_group, **settings)


class SDLRT(AugmentedBUG):
    r"""Stabilised DLRT: DLRT plus the compensation buffer and the tolerance feedback
    (:class:`AugmentedBUG` with ``buffer=True`` and a :class:`SeedFeedback` or
    :class:`TwoSidedFeedback`).

    - **buffer**: the augmented bases also span the previous step's buffer,
      ``Ū = orth[U0, ΔK, U_buf]``; after truncation to rank r1 the next ≤ r1 discarded
      singular directions (mapped through the augmented bases) become the new buffer.
    - **feedback**: ``True`` / ``"seed"`` (the paper's rule): whenever the new rank is below
      the layer's initial rank, τ ← ωτ (never below `tau_min`). The feedback fires on *every*
      such step, so τ decays geometrically while the rank stays low: by design default SDLRT
      pushes each layer back to (at least) its initial rank. Use `tau_min` as a floor.
      ``"two-sided"`` also relaxes τ ← τ/ω (up to max(τ, 0.5)) whenever the rank is above the
      initial rank, so τ settles once the rank sits there (:class:`TwoSidedFeedback`).
      With a `target` there is no τ to adjust and the feedback is not used.
    """

    def __init__(self, model: nn.Module, lr: float, *, tau: float | None = None,
                 target: float | None = None, ramp_steps: int | None = None, allocation: str | None = None,
                 omega: float = 0.8, buffer: bool = True, feedback: bool | str = True,
                 tau_min: float = 0.0, process_group=None, **settings) -> None:
        _refuse(type(self).__name__, settings, ("truncation",))
        rule = pop_rule(settings)  # its arguments are checked before the policies'
        truncation = _truncation(tau, target, ramp_steps, allocation)
        if feedback not in (True, False, "seed", "two-sided"):
            raise ValueError(f"`feedback` must be True / 'seed' (the paper's τ ← ωτ), 'two-sided' or "
                             f"False; got {feedback!r}")
        if isinstance(truncation, Tolerance) and not 0 <= tau_min <= truncation.tau:
            raise ValueError(f"`tau_min` must be in [0, tau={truncation.tau}]; got {tau_min}")
        fb = None
        if feedback and isinstance(truncation, Tolerance):  # a budget has no τ to adjust
            fb = _FEEDBACK[feedback](omega=omega, tau_min=tau_min)
        elif not 0 < omega < 1:
            raise ValueError(f"`omega` must be in (0, 1); got {omega}")
        super().__init__(model, lr, truncation=truncation, feedback=fb, buffer=buffer, rule=rule,
                         process_group=process_group, **settings)


# (the options common to both presets, written once; a docstring literal cannot be concatenated)
DLRT.__doc__ += _COMMON_DOC + """
    Example: ``opt = DLRT(model, 0.05, tau=0.1); loss = opt.step(closure)``.
"""
SDLRT.__doc__ += _COMMON_DOC + """
    - `omega`: feedback factor ω in (0, 1); `buffer`, `feedback`: switch each part off
      separately (with both off this is DLRT).
"""
