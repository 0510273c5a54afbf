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

    Gradient clipping (``max_grad_norm``, 1.0 by default in ``TrainingArguments``) would rescale
    only the ``.grad`` of the cores and dense parameters, not the factor gradients the
    integrator reads, so it is switched off with a warning. ``optimizers=(opt, scheduler)``
    still lets you pass an optimizer of your own.
    """

    def __init__(self, model=None, args=None, *pos, **kw) -> None:
        _config_of(model)
        super().__init__(model, args, *pos, **kw)
        if self.args.max_grad_norm:
            warnings.warn(f"RankwiseTrainer: max_grad_norm={self.args.max_grad_norm} switched off: clipping "
                          "would rescale the cores' gradients but not the factor gradients the integrator "
                          "reads", UserWarning, stacklevel=2)
            self.args.max_grad_norm = 0.0

    def create_optimizer(self, model=None):
        if self.optimizer is None:
            a = self.args
            self.optimizer = adapter_optimizer(self.model, a.learning_rate, optimizer="adam",
                                               betas=(a.adam_beta1, a.adam_beta2), eps=a.adam_epsilon,
                                               weight_decay=a.weight_decay)
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
