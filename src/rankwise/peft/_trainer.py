"""RankwiseTrainer: ``transformers.Trainer`` whose optimizer is the adapters' integrator."""

from __future__ import annotations

import warnings

import transformers

from ._model import _config_of, adapter_optimizer, adapters


class RankwiseTrainer(transformers.Trainer):
    """A ``transformers.Trainer`` for a model wrapped by :func:`get_adapter_model`.

    Its optimizer is the DLRT/SDLRT integrator of the model's :class:`AdapterConfig`
    (:func:`adapter_optimizer`, with Adam's moments: ``TrainingArguments``' learning rate,
    ``adam_beta1/2``, ``adam_epsilon`` and ``weight_decay``, as L2). The basis update and
    truncation happen inside ``optimizer.step()``, which the Trainer calls at every step, so
    there is no extra call to forget (PEFT's AdaLoRA needs ``update_and_allocate`` each step).
    The learning-rate schedule applies as usual. Each log entry gets ``adapter_rank/<module>``,
    ``adapter_rank_total`` and ``adapter_tau_mean``, so every logger (TensorBoard, W&B, the
    console) sees the ranks and τ.

    Gradient clipping (``max_grad_norm``, 1.0 by default in ``TrainingArguments``) is done by
    :func:`rankwise.clip_grad_norm_` just before each optimizer step (a pre-step hook), so it
    also scales the factor gradients the integrator reads, which the Trainer's own clipping
    would miss (``clip_norm`` holds the value; the Trainer's ``max_grad_norm`` is set to 0).
    Under ``fp16`` the gradients are still scaled at that point, so clipping is switched off
    there, with a warning. ``optimizers=(opt, scheduler)`` still lets you pass an optimizer of
    your own (it is clipped the same way).
    """

    def __init__(self, model=None, args=None, *pos, **kw) -> None:
        _config_of(model)
        super().__init__(model, args, *pos, **kw)
        self.clip_norm = float(self.args.max_grad_norm or 0.0)
        self.args.max_grad_norm = 0.0  # the Trainer's clipping would miss the factor gradients
        if self.clip_norm and self.args.fp16:
            warnings.warn(f"RankwiseTrainer: max_grad_norm={self.clip_norm} switched off under fp16: the "
                          "gradients are still scaled when the step begins", UserWarning, stacklevel=2)
            self.clip_norm = 0.0
        if self.optimizer is not None:
            self._clip_before_steps(self.optimizer)

    def _clip_before_steps(self, opt) -> None:
        if not self.clip_norm:
            return
        from ..lowrank import clip_grad_norm_

        model, norm = self.model, self.clip_norm

        def clip(_opt, _args, _kwargs) -> None:
            clip_grad_norm_(model, norm)

        opt.register_step_pre_hook(clip)

    def create_optimizer(self, model=None):
        if self.optimizer is None:
            a = self.args
            self.optimizer = adapter_optimizer(self.model, a.learning_rate, optimizer="adam",
                                               betas=(a.adam_beta1, a.adam_beta2), eps=a.adam_epsilon,
                                               weight_decay=a.weight_decay)
            self._clip_before_steps(self.optimizer)
        return self.optimizer

    def log(self, logs: dict[str, float], *args, **kwargs) -> None:
        ranks = {name: layer.rank for name, layer in adapters(self.model)}
        logs = dict(logs)
        logs.update({f"adapter_rank/{name}": r for name, r in ranks.items()})
        logs["adapter_rank_total"] = sum(ranks.values())
        opt = getattr(self.optimizer, "optimizer", self.optimizer)  # accelerate wraps it
        taus = getattr(opt, "taus", None)
        if taus is not None:
            values = list(taus().values())
            logs["adapter_tau_mean"] = sum(values) / max(len(values), 1)
        super().log(logs, *args, **kwargs)
