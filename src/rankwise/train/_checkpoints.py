"""Coded checkpoints of a :func:`rankwise.train.fit` run: save every few steps, resume after a restart."""

from __future__ import annotations

import random
from typing import Any

import torch

from ._loop import Callback, Loop

_LAYOUT = {"identity", "model", "optim", "loop", "callbacks"}  # what on_step_end saves


class CodedCheckpoints(Callback):
    """A 2-D coded checkpoint (:class:`rankwise.ckpt.CodedCheckpointer`) every `every` steps;
    at the start of a run, the newest one is restored (a lost rank's fragment repaired from its
    peers) and the run continues from the step after it, bit for bit as if uninterrupted.

    A checkpoint holds the model's and the optimizer's state dicts, the :class:`Loop`'s
    position (epoch, step, the epoch's order, the shuffling generator), the ``state_dict`` of
    every other callback, and per rank the global torch and Python RNG states. Put this
    callback first, so that the others see the restored state in their ``on_fit_start``.

    **Arguments:**
    - `checkpointer`: a :class:`rankwise.ckpt.CodedCheckpointer` on the run's process group.
    - `every`: steps between checkpoints (a checkpoint after every `every`-th step of the run).
    - `identity`: what must be equal for a checkpoint to belong to this run (e.g. the run's
      settings); a checkpoint saved with another identity is refused with a ``ValueError``
      naming the differences. Default ``None``: not checked.
    - `blocking`: ``False`` saves in the background (``CodedCheckpointer.save(blocking=False)``:
      training waits only for the snapshot to host memory; the next save, and the end of the
      run, wait for the one in flight). Default ``True``.

    **Attributes:** `restored` — ``None``, or ``{"step": ..., "repaired_ranks": [...], "skipped":
    [{"step": ..., "why": ...}]}`` (newer steps that could not be retrieved: a fall-back) after a
    restore.
    """

    def __init__(self, checkpointer, every: int, *, identity: dict[str, Any] | None = None,
                 blocking: bool = True) -> None:
        if not isinstance(every, int) or isinstance(every, bool) or every < 1:
            raise ValueError(f"`every` must be an int >= 1 (steps); got {every!r}")
        self.checkpointer, self.every, self.identity = checkpointer, every, identity
        self.blocking = blocking
        self.restored: dict[str, Any] | None = None

    def _others(self, loop: Loop) -> dict[str, Callback]:
        return {f"{i}:{type(cb).__name__}": cb for i, cb in enumerate(loop.callbacks) if cb is not self}

    def on_fit_start(self, loop: Loop) -> None:
        got = self.checkpointer.restore()
        if got is None:
            return
        state = got.state
        if not isinstance(state, dict) or not set(state) >= _LAYOUT:
            raise ValueError(f"{self.checkpointer.root_dir} holds a checkpoint of another layout (written by "
                             "another version of rankwise or another program); choose another folder")
        if state["identity"] != self.identity:
            raise ValueError(f"{self.checkpointer.root_dir} holds a checkpoint of another run ("
                             + mismatch(state["identity"] or {}, self.identity or {})
                             + "); choose another checkpoint folder")
        loop.model.load_state_dict(state["model"])
        loop.optimizer.load_state_dict(state["optim"])
        loop.load_state_dict(state["loop"])
        for key, cb in self._others(loop).items():
            if key in state["callbacks"]:
                cb.load_state_dict(state["callbacks"][key])
        torch.set_rng_state(got.per_rank["torch_rng"])
        random.setstate(got.per_rank["py_rng"])
        self.restored = {"step": got.step, "repaired_ranks": got.repaired,
                         "skipped": [{"step": s, "why": why} for s, why in got.skipped]}

    def on_step_end(self, loop: Loop) -> None:
        if loop.global_step % self.every:
            return
        callbacks = {k: s for k, cb in self._others(loop).items() if (s := cb.state_dict()) is not None}
        state = {"identity": self.identity, "model": loop.model.state_dict(),
                 "optim": loop.optimizer.state_dict(), "loop": loop.state_dict(), "callbacks": callbacks}
        self.checkpointer.save(state, loop.global_step, blocking=self.blocking,
                               per_rank={"torch_rng": torch.get_rng_state(), "py_rng": random.getstate()})

    def on_fit_end(self, loop: Loop) -> None:
        self.checkpointer.wait()  # a background save in flight lands before the run ends


def mismatch(saved: dict, now: dict) -> str:
    """``"lr: 0.05 there, 0.1 here; ..."``: how a checkpoint's settings differ from this run's."""
    keys = sorted(set(saved) | set(now))
    return "; ".join(f"{k}: {saved.get(k)!r} there, {now.get(k)!r} here"
                     for k in keys if saved.get(k) != now.get(k))
