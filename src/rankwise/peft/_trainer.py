"""RankwiseTrainer: ``transformers.Trainer`` whose optimizer is rankwise's integrator."""

from __future__ import annotations

import copy
import warnings
from collections.abc import Mapping
from typing import Any

import transformers
from torch import Tensor, nn

from ._config import AdapterConfig
from ._model import adapter_optimizer, adapters

# TrainingArguments.optim values that build torch.optim.AdamW (fused or not, on any device):
# what the integrator's AdamW rule reproduces. Any other optimizer is refused, not replaced.
ADAMW_OPTIMS = ("adamw_torch", "adamw_torch_fused", "adamw_torch_xla", "adamw_torch_npu_fused")
# what TrainingArguments set (the rule) or the Trainer passes itself: not in `integrator=`
_FROM_ARGS = ("lr", "optimizer", "momentum", "weight_decay", "betas", "eps", "decoupled_weight_decay",
              "rule", "settings", "param_groups")
_METHODS = ("dlrt", "sdlrt")

# a compression target's ramp: this share of the run's optimizer steps (as `rankwise train`'s)
RAMP_SHARE = 0.9


def _is_adapter_model(model: nn.Module) -> bool:
    config = getattr(model, "adapter_config", None)
    return isinstance(config, AdapterConfig) and any(True for _ in adapters(model))


def _low_rank_layers(model: nn.Module) -> dict[str, nn.Module]:
    """{name: layer} of every rankwise low-rank layer (adapters included)."""
    from ..nn import AbstractLowRankLayer

    return {n: m for n, m in model.named_modules() if isinstance(m, AbstractLowRankLayer)}


def _check_model(model: object) -> bool:
    """True for an adapter model (:func:`get_adapter_model`), False for one converted with
    ``rankwise.to_low_rank``; ``ValueError`` for a model with neither."""
    if not isinstance(model, nn.Module):
        raise TypeError(f"RankwiseTrainer needs `model`, an nn.Module; got {type(model).__name__}")
    if _is_adapter_model(model):
        return True
    if not _low_rank_layers(model):
        raise ValueError("RankwiseTrainer: `model` has no rankwise layers: wrap it with "
                         "rankwise.peft.get_adapter_model(model, AdapterConfig(...)) or convert it with "
                         "rankwise.to_low_rank(model, ...) first")
    return False


def _check_integrator(integrator: Mapping[str, Any] | None, is_adapter: bool) -> dict[str, Any]:
    """The integrator's keyword arguments, checked: nothing the TrainingArguments decide, and
    for a ``to_low_rank`` model a truncation (`tau` or `target`) and a `method`."""
    kw = dict(integrator or {})
    if taken := sorted(set(kw) & set(_FROM_ARGS)):
        raise ValueError(f"RankwiseTrainer(integrator=...) got {taken}: the rule comes from "
                         "TrainingArguments (learning_rate, adam_beta1, adam_beta2, adam_epsilon, "
                         "weight_decay); set it there")
    if is_adapter:
        if "method" in kw or "tau" in kw:
            raise ValueError("RankwiseTrainer: an adapter model's method and τ come from its AdapterConfig; "
                             "leave `method` and `tau` out of integrator=")
        return kw
    if kw.get("method", "dlrt") not in _METHODS:
        raise ValueError(f"RankwiseTrainer(integrator={{'method': ...}}) must be one of {_METHODS}; "
                         f"got {kw['method']!r}")
    if "tau" not in kw and "target" not in kw:
        raise ValueError("RankwiseTrainer: a model converted with to_low_rank needs the integrator's "
                         "truncation: RankwiseTrainer(..., integrator={'tau': 0.1}) or {'target': 0.9}")
    return kw


def _check_args(args: transformers.TrainingArguments) -> None:
    """Refuse TrainingArguments that ask for an optimizer the integrator cannot be."""
    optim = str(getattr(args.optim, "value", args.optim))
    if optim not in ADAMW_OPTIMS:
        raise ValueError(f"RankwiseTrainer: TrainingArguments(optim={optim!r}) is not supported: the "
                         "integrator applies AdamW (optim='adamw_torch', the default); for another rule "
                         "pass optimizers=(rankwise.DLRT(model, lr, tau=..., momentum=0.9), None)")


class RankwiseTrainer(transformers.Trainer):
    """A ``transformers.Trainer`` for a model wrapped by :func:`get_adapter_model` or converted
    by ``rankwise.to_low_rank`` (any model holding rankwise low-rank layers).

    Its optimizer is rankwise's integrator with the rule the Trainer's default optimizer
    (``torch.optim.AdamW``) has: the AdamW rule (decoupled weight decay,
    ``rankwise.AdamW``) with ``TrainingArguments``' ``learning_rate``, ``adam_beta1/2``,
    ``adam_epsilon`` and ``weight_decay``, which, as the Trainer does, spares the parameters it
    names in :meth:`get_decay_parameter_names` (biases and norms: a param group with
    ``weight_decay=0``). The integrator is

    - for an adapter model, the one its :class:`AdapterConfig` asks for
      (:func:`adapter_optimizer`; `integrator` adds its other arguments, e.g.
      ``{"update_every": 2}``);
    - for a ``to_low_rank`` model, ``rankwise.DLRT`` (or ``rankwise.SDLRT`` with
      ``integrator={"method": "sdlrt", ...}``) with the keyword arguments of `integrator`, which
      must give the truncation: ``{"tau": 0.1}`` or ``{"target": 0.9}`` (a target is reached
      over the first 90 % of the run's optimizer steps unless ``ramp_steps`` is given).

    The basis update and truncation happen inside ``optimizer.step()``, which the Trainer calls
    at every step, so there is no extra call to forget (PEFT's AdaLoRA needs
    ``update_and_allocate`` each step). The learning-rate schedule applies as usual. Each log
    entry gets the ranks and τ (``adapter_rank/<module>``, ``adapter_rank_total``,
    ``adapter_tau_mean`` for adapters; ``rank/<module>``, ``rank_total``, ``tau_mean``
    otherwise), so every logger sees them.

    Gradient clipping (``max_grad_norm``, 1.0 by default in ``TrainingArguments``) is done by
    :func:`rankwise.clip_grad_norm_`, in the Trainer's place, so it also scales the factor
    gradients the integrator reads, which the Trainer's own clipping would miss; the logged
    ``grad_norm`` is that norm. The caller's ``TrainingArguments`` are never changed. Under
    ``fp16`` the gradients are still scaled at that point, so clipping is switched off there,
    with a warning. ``optimizers=(opt, scheduler)`` still lets you pass an optimizer of your
    own (it is clipped the same way).

    Refused at construction, in one line each: ``TrainingArguments(optim=...)`` other than
    torch's AdamW, ``optimizer_cls_and_kwargs`` (the Trainer would build that class from
    parameter lists; the integrator needs the model), `integrator` keys that
    ``TrainingArguments`` set (``lr``, ``weight_decay``, ``betas``, ...), and a model with no
    rankwise layers.
    """

    def __init__(self, model=None, args=None, *pos, integrator: Mapping[str, Any] | None = None,
                 **kw) -> None:
        self._adapters = _check_model(model)
        self.integrator = _check_integrator(integrator, self._adapters)
        if kw.get("optimizer_cls_and_kwargs") is not None:
            raise ValueError("RankwiseTrainer: optimizer_cls_and_kwargs is not supported (the Trainer "
                             "would build that class from parameter lists); pass "
                             "optimizers=(rankwise.DLRT(model, lr, ...), None), or leave it out")
        super().__init__(model, args, *pos, **kw)
        if self.optimizer is None:
            _check_args(self.args)
        self.clip_norm = float(self.args.max_grad_norm or 0.0)
        if self.clip_norm and self.args.fp16:
            warnings.warn(f"RankwiseTrainer: max_grad_norm={self.clip_norm} switched off under fp16: the "
                          "gradients are still scaled when the step begins", UserWarning, stacklevel=2)
            self.clip_norm = 0.0
        self._hooked = not hasattr(transformers.Trainer, "_clip_grad_norm")
        if self._hooked:  # older transformers clip inline: a copy of the args without, clipped by a hook
            self.args = copy.copy(self.args)
            self.args.max_grad_norm = 0.0
            if self.optimizer is not None:
                self._clip_before_steps(self.optimizer)

    def _clip_grad_norm(self, model: nn.Module) -> Tensor:
        """The Trainer's clipping step (when ``max_grad_norm`` > 0): :func:`rankwise.clip_grad_norm_`,
        which also reaches the factor gradients; returns the norm before clipping."""
        from ..optim import clip_grad_norm_, grad_norm

        return clip_grad_norm_(model, self.clip_norm) if self.clip_norm else grad_norm(model)

    def _clip_before_steps(self, opt) -> None:
        if not self.clip_norm:
            return
        from ..optim import clip_grad_norm_

        model, norm = self.model, self.clip_norm

        def clip(_opt, _args, _kwargs) -> None:
            clip_grad_norm_(model, norm)

        opt.register_step_pre_hook(clip)

    def _param_groups(self) -> list[dict]:
        """The Trainer's no-decay group (biases and norms, :meth:`get_decay_parameter_names`),
        if it holds any trainable parameter; the others take the first group's decay."""
        decay = set(self.get_decay_parameter_names(self.model))
        spared = [p for n, p in self.model.named_parameters() if n not in decay and p.requires_grad]
        return [{"params": spared, "weight_decay": 0.0}] if spared else []

    def create_optimizer_and_scheduler(self, num_training_steps: int) -> None:
        self._num_training_steps = num_training_steps  # (a target's ramp follows the run's length)
        super().create_optimizer_and_scheduler(num_training_steps)

    def _ramp(self, kw: dict[str, Any]) -> None:
        """A `target` without ``ramp_steps`` ramps over :data:`RAMP_SHARE` of the Trainer's
        optimizer steps (counted in augmentations), not DLRT's default 200 augmentations, which
        a short run would never reach."""
        # (transformers 4 passes the run's length to create_optimizer_and_scheduler; 5 sets it
        # on the state before create_optimizer)
        steps = getattr(self, "_num_training_steps", None) or getattr(self.state, "max_steps", 0)
        if kw.get("target") is not None and "ramp_steps" not in kw and steps:
            kw["ramp_steps"] = max(1, int(RAMP_SHARE * steps) // int(kw.get("update_every", 1)))

    def create_optimizer(self, model=None):
        if self.optimizer is None:
            from ..optim import DLRT, SDLRT

            a = self.args
            kw = dict(self.integrator, optimizer="adamw", betas=(a.adam_beta1, a.adam_beta2),
                      eps=a.adam_epsilon, weight_decay=a.weight_decay)
            if groups := self._param_groups():
                kw["param_groups"] = groups
            if self._adapters:
                self.optimizer = adapter_optimizer(self.model, a.learning_rate, **kw)
            else:
                cls = SDLRT if kw.pop("method", "dlrt") == "sdlrt" else DLRT
                self._ramp(kw)
                self.optimizer = cls(self.model, a.learning_rate, **kw)
            if self._hooked:
                self._clip_before_steps(self.optimizer)
        return self.optimizer

    def log(self, logs: dict[str, float], *args, **kwargs) -> None:
        if self._adapters:
            ranks, prefix = {name: layer.rank for name, layer in adapters(self.model)}, "adapter_"
        else:
            ranks, prefix = {name: layer.rank for name, layer in _low_rank_layers(self.model).items()}, ""
        logs = dict(logs)
        logs.update({f"{prefix}rank/{name}": r for name, r in ranks.items()})
        logs[f"{prefix}rank_total"] = sum(ranks.values())
        opt = getattr(self.optimizer, "optimizer", self.optimizer)  # accelerate wraps it
        taus = getattr(opt, "taus", None)
        if taus is not None:
            values = list(taus().values())
            logs[f"{prefix}tau_mean"] = sum(values) / max(len(values), 1)
        super().log(logs, *args, **kwargs)
