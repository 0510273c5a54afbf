"""The training loop: :func:`fit` and the :class:`Callback` s that log, checkpoint and watch it.

One loop for every run rankwise makes — the digits runs of ``rankwise train``, the sweeps, the
ODE sequence models and the checkpoint demo — in one process or data-parallel. It imports torch
only: no logging backend, no data set.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from .._checks import check_training
from ..optim._clip import clip_grad_norm_


class Callback:
    """Hooks called by :func:`fit`, each with the :class:`Loop`; override the ones you need.

    A callback may set ``loop.stop = True`` (the run ends after this step; the unfinished
    epoch's ``on_epoch_end`` is not called) or replace ``loop.optimizer`` (e.g. in
    ``on_epoch_start``). What a checkpoint keeps of it is its :meth:`state_dict`.
    """

    def on_fit_start(self, loop: Loop) -> None:
        """Before the first step (and after a restore, for callbacks after the checkpointer)."""

    def on_epoch_start(self, loop: Loop) -> None:
        """After the epoch's order is drawn, before its first step (not for a resumed epoch)."""

    def on_after_backward(self, loop: Loop) -> None:
        """After the backward pass (and the clipping) of a step, before the optimizer changes
        the weights: the gradients of this step are in place (for the low-rank layers of an
        integrator, the factor gradients it reads). Called from the closure the optimizer calls,
        so once per closure call: twice a step for a two-pass integrator (``single_pass=False``).
        ``loop.loss``, ``loop.x``, ``loop.y`` are still the previous step's."""

    def on_step_end(self, loop: Loop) -> None:
        """After every optimizer step; ``loop.loss``, ``loop.x``, ``loop.y`` are that step's."""

    def on_epoch_end(self, loop: Loop) -> None:
        """After an epoch's last step."""

    def on_fit_end(self, loop: Loop) -> None:
        """After the last step (also after ``loop.stop``; not after an exception)."""

    def state_dict(self) -> dict[str, Any] | None:
        """What a checkpoint keeps of this callback (``None``: nothing)."""
        return None

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore what :meth:`state_dict` returned."""


class Loop:
    """The state of a :func:`fit` run, as its callbacks see it.

    **Attributes:**
    - `model`, `optimizer` (callbacks may replace the optimizer), `callbacks`.
    - `process_group`, `rank`, `world`: the data-parallel group (``None``, 0, 1 in one process).
    - `epochs`, `steps` (per epoch), `batch_size`, `max_steps` (``None``: no limit).
    - `epoch` (1-based), `step` (steps done in this epoch), `global_step` (steps done in the run).
    - `order`: this epoch's permutation of the sample indices (N,) int64.
    - `loss`: the last step's mean loss over the whole batch (all ranks).
    - `loss_sum`, `correct_sum`, `seen`: this epoch's sums over whole batches (running means:
      ``loss_sum / seen``; `correct_sum` counts the samples classified right before their step,
      for class-index targets).
    - `x`, `y`: this rank's shard of the last batch; `step_seconds`: the last step's forward,
      backward and optimizer time; `epoch_started`: ``time.perf_counter()`` at the epoch's
      start (or at the resume).
    - `stop`: set by a callback to end the run after this step.
    """

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer, *, callbacks: Sequence[Callback],
                 process_group, epochs: int, steps: int, batch_size: int, max_steps: int | None,
                 shuffle: torch.Generator | None) -> None:
        import torch.distributed as dist

        self.model, self.optimizer, self.callbacks = model, optimizer, list(callbacks)
        self.process_group = process_group
        self.rank = 0 if process_group is None else dist.get_rank(process_group)
        self.world = 1 if process_group is None else dist.get_world_size(process_group)
        self.epochs, self.steps, self.batch_size, self.max_steps = epochs, steps, batch_size, max_steps
        self.shuffle = shuffle
        self.epoch, self.step, self.global_step = 1, 0, 0
        self.order: Tensor | None = None
        self.loss = math.nan
        self.loss_sum, self.correct_sum, self.seen = 0.0, 0.0, 0
        self.x: Tensor | None = None
        self.y: Tensor | None = None
        self.step_seconds = 0.0
        self.epoch_started = time.perf_counter()
        self.stop = False

    def state_dict(self) -> dict[str, Any]:
        """Where the run is: epoch, step, the epoch's order and sums, the shuffling generator."""
        return {"epoch": self.epoch, "step": self.step, "global_step": self.global_step, "order": self.order,
                "sums": [self.loss_sum, self.correct_sum, self.seen],
                "shuffle": None if self.shuffle is None else self.shuffle.get_state()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.epoch, self.step, self.global_step = state["epoch"], state["step"], state["global_step"]
        self.order = state["order"]
        self.loss_sum, self.correct_sum, self.seen = state["sums"]
        if (state["shuffle"] is None) != (self.shuffle is None):
            raise ValueError("the checkpoint shuffled with a generator and this run does not, or the reverse")
        if self.shuffle is not None:
            self.shuffle.set_state(state["shuffle"])

    @property
    def done(self) -> bool:
        return self.stop or (self.max_steps is not None and self.global_step >= self.max_steps)

    def _emit(self, hook: str) -> None:
        for cb in self.callbacks:
            getattr(cb, hook)(self)


def fit(model: nn.Module, optimizer: torch.optim.Optimizer, x: Tensor, y: Tensor, *, epochs: int | None = 1,
        batch_size: int = 32, max_steps: int | None = None, shuffle: torch.Generator | None = None,
        drop_last: bool = False,
        loss_fn: Callable[[Tensor, Tensor], Tensor] = F.cross_entropy, callbacks: Sequence[Callback] = (),
        process_group=None, clip_grad_norm: float | None = None,
        transform: Callable[[Tensor, Tensor], tuple[Tensor, Tensor]] | None = None) -> Loop:
    """Train `model` with `optimizer` on the samples ``x`` (N, ...) and targets ``y`` (N, ...).

    Every epoch draws a permutation of the N samples (``torch.randperm`` with `shuffle`, or
    with the global RNG when it is ``None``) and takes minibatches of `batch_size` from it, the
    last one possibly smaller (or left out, with `drop_last`). Each step calls
    ``optimizer.step(closure)``; the closure zeroes the gradients, computes
    ``loss_fn(model(x_b), y_b)`` (a mean over the batch), back-propagates, with
    `clip_grad_norm` clips the gradients' global norm (:func:`rankwise.clip_grad_norm_`: for
    low-rank layers trained by an integrator, the factor gradients it reads) and calls the
    callbacks' :meth:`Callback.on_after_backward`. Works with torch
    optimizers and with rankwise's integrators (:class:`rankwise.DLRT`, :class:`rankwise.SDLRT`),
    which call the closure themselves.

    **Data-parallel** (`process_group` with more than one rank, e.g.
    ``torch.distributed.group.WORLD`` under torchrun): every rank draws the same permutation (seed
    `shuffle` alike on every rank) and trains on its contiguous shard of every batch, with the
    loss scaled so that the average of the ranks' gradients is the whole batch's mean-loss
    gradient (the optimizer averages them: DDP for dense models, ``process_group=`` for
    rankwise's integrators). ``loop.loss`` is then the whole batch's loss on every rank.

    **Arguments:**
    - `epochs` ≥ 1, `batch_size` ≥ 1; `max_steps`: stop after this many steps in all (with
      ``epochs=None``: as many epochs as those steps take).
    - `callbacks`: :class:`Callback` s, called in this order at every hook.
    - `transform(x_b, y_b) -> (x_b, y_b)`: applied to this rank's shard before the forward pass
      (e.g. noise augmentation).

    **Returns:** the :class:`Loop` (its final state). A resumed run (a callback that restores
    ``loop.load_state_dict`` in ``on_fit_start``, as :class:`rankwise.train.CodedCheckpoints`
    does) continues from the step it saved.
    """
    for name, v in (("x", x), ("y", y)):
        if not isinstance(v, Tensor):
            raise TypeError(f"`{name}` must be a torch.Tensor; got {type(v).__module__}.{type(v).__name__} "
                            f"(convert it with torch.as_tensor({name}))")
    n = len(x)
    if len(y) != n:
        raise ValueError(f"x and y differ in length: {n} samples, {len(y)} targets")
    if n == 0:
        raise ValueError("no training samples (x is empty)")
    if epochs is None and max_steps is None:
        raise ValueError("give `epochs`, or `max_steps` with epochs=None")
    check_training(batch_size=batch_size)
    if drop_last and n < batch_size:
        raise ValueError(f"drop_last with {n} samples and batch_size {batch_size} leaves no batch")
    if max_steps is not None:
        check_training(max_steps=max_steps)
    steps = n // batch_size if drop_last else math.ceil(n / batch_size)
    if epochs is None:
        check_training(max_steps=max_steps)
        epochs = math.ceil(max_steps / steps)
    check_training(epochs=epochs)
    loop = Loop(model, optimizer, callbacks=callbacks, process_group=process_group, epochs=epochs,
                steps=steps, batch_size=batch_size, max_steps=max_steps, shuffle=shuffle)
    loop._emit("on_fit_start")  # a checkpointer among the callbacks may move the loop on here
    resumed = loop.order is not None
    model.train()
    while loop.epoch <= epochs and not loop.done:
        if not resumed:
            loop.order = torch.randperm(n, generator=shuffle)
            loop.step, loop.loss_sum, loop.correct_sum, loop.seen = 0, 0.0, 0.0, 0
            loop._emit("on_epoch_start")
        resumed = False
        loop.epoch_started = time.perf_counter()
        while loop.step < loop.steps and not loop.done:
            _step(loop, x, y, loss_fn, clip_grad_norm, transform)
            loop._emit("on_step_end")
        if loop.stop:
            break
        if loop.step == loop.steps:
            loop._emit("on_epoch_end")
            model.train()
            loop.epoch += 1
            loop.step = 0
            loop.order = None
    loop._emit("on_fit_end")
    return loop


def _step(loop: Loop, x: Tensor, y: Tensor, loss_fn, clip: float | None, transform) -> None:
    b = loop.batch_size
    idx = loop.order[loop.step * b:(loop.step + 1) * b]
    batch = len(idx)
    if loop.world > 1:
        idx = idx[loop.rank * batch // loop.world:(loop.rank + 1) * batch // loop.world]
    xb, yb = x[idx], y[idx]
    if transform is not None:
        xb, yb = transform(xb, yb)
    outputs: list[Tensor] = []
    model = loop.model

    @torch.enable_grad()  # some optimizers (GaLore's) call the closure under no_grad
    def closure() -> Tensor:
        loop.optimizer.zero_grad()
        out = model(xb)
        if loop.world == 1:
            loss = loss_fn(out, yb)
        elif len(yb):  # this shard's share of the batch mean; averaged over ranks: the batch's
            loss = loss_fn(out, yb) * (len(yb) * loop.world / batch)
        else:  # an empty shard (a last batch smaller than the group): zero, not a mean over nothing
            loss = out.sum() * 0.0
        loss.backward()
        if clip is not None:  # also the factor gradients of low-rank layers (torch's misses them)
            clip_grad_norm_(model, clip)
        loop._emit("on_after_backward")
        outputs.append(out.detach())
        return loss

    t0 = time.perf_counter()
    loss = float(loop.optimizer.step(closure).detach())
    loop.step_seconds = time.perf_counter() - t0
    out = outputs[0]  # the logits before the step (a two-pass integrator calls the closure twice)
    hits = float((out.argmax(1) == yb).sum()) if out.dim() == 2 and not yb.is_floating_point() else 0.0
    if loop.world > 1:  # the whole batch's, on every rank
        t = torch.tensor([loss * batch / loop.world, hits], dtype=torch.float64)
        torch.distributed.all_reduce(t, group=loop.process_group)
        loss, hits = float(t[0]) / batch, float(t[1])
    loop.loss = loss
    loop.loss_sum += loss * batch
    loop.correct_sum += hits
    loop.seen += batch
    loop.step += 1
    loop.global_step += 1
    loop.x, loop.y = xb, yb


@torch.no_grad()
def accuracy(model: nn.Module, x: Tensor, y: Tensor, batch: int = 1024) -> float:
    """Share of correctly classified samples, x (N, ...), y (N,) int64, evaluated in eval mode
    in batches of `batch`; the model's training mode is restored afterwards."""
    was_training = model.training
    model.eval()
    correct = sum(int((model(x[i:i + batch]).argmax(1) == y[i:i + batch]).sum())
                  for i in range(0, len(y), batch))
    model.train(was_training)
    return correct / len(y)
