"""A :class:`~rankwise.Budget`'s bookkeeping inside an optimizer (the allocation itself is the
pure :func:`rankwise.nn._budget.allocate_ranks`)."""

from __future__ import annotations

from torch import Tensor

from ..nn._budget import layer_cost
from ..nn._metrics import compression


class Planner:
    """A :class:`~rankwise.Budget`'s bookkeeping for one optimizer: the model's dense size, the
    parameters outside the low-rank layers (biases, dense layers: fixed), what the layers hold
    and the ranks at each augmentation. `layers`: {name: layer}, `rank_cap`: a layer's largest
    rank; checks at construction that the target or parameter count can be reached."""

    def __init__(self, model, layers: dict, settings, rank_cap) -> None:
        truncation, min_rank = settings.truncation, settings.min_rank
        self.truncation, self.min_rank, self.layers, self.rank_cap = truncation, min_rank, layers, rank_cap
        c = compression(model)
        factors = sum(m.live_params() for m in layers.values())
        self.dense_params = c["dense_params"]
        self.other_params = c["stored_params"] - factors
        # frozen layers keep their rank: fixed, like the parameters outside the layers
        fixed = self.other_params + sum(m.live_params() for m in layers.values() if not m.S.requires_grad)
        self.count_buffer = bool(truncation.count_buffer and settings.buffer)
        if truncation.target is not None and (1 - truncation.target) * self.dense_params <= fixed:
            raise ValueError(f"`target`={truncation.target} cannot be reached: the parameters outside "
                             f"the trainable low-rank factors (biases, dense layers, frozen low-rank layers) "
                             f"alone are {fixed:,} of {self.dense_params:,}")
        least = sum(layer_cost(m.out_features, m.in_features, min(min_rank, m.max_rank),
                               buffer=self.count_buffer) for m in layers.values() if m.S.requires_grad)
        if truncation.params is not None and truncation.params < least:
            raise ValueError(f"`params`={truncation.params:,} cannot hold the low-rank layers at "
                             f"min_rank={min_rank}: that alone costs {least:,} parameters")

    def held(self) -> int:
        """What the low-rank layers hold, as the budget counts it (U, S, V; with a counted
        buffer, its largest size b = r: :func:`layer_cost`)."""
        return sum(layer_cost(m.out_features, m.in_features, m.rank, buffer=self.count_buffer)
                   for m in self.layers.values())

    def start(self) -> int:
        """The stored parameters now: where the schedule starts (kept in the param group)."""
        return self.other_params + self.held()

    def now(self, augmentation: int, start: float) -> float:
        """The budget (stored parameters) at this augmentation (:meth:`Budget.params_at`)."""
        return self.truncation.params_at(augmentation, start, self.dense_params, self.other_params)

    def report(self, augmentation: int, start: float) -> dict[str, float]:
        """The budget now and at the end, the parameters stored now and their compression."""
        stored = self.start()
        return {"target": self.truncation.target, "budget_params": self.now(augmentation, start),
                "target_params": self.truncation.end_params(self.dense_params, self.other_params),
                "stored_params": stored, "compression": 1 - stored / self.dense_params,
                "layer_params": self.held()}

    def ranks(self, spectra: dict[str, Tensor], scores: dict[str, list[float]] | None, augmentation: int,
              start: float) -> dict[str, int]:
        """The rank of each layer planned in this step (`spectra`: its augmented core's singular
        values, in the order the layer keeps its directions, in the model's order) under the
        current budget, allocated model-wide (:func:`allocate_ranks`); layers not in this step
        keep their rank and cost. From `Budget.freeze_after` on, every layer keeps its rank.
        `scores`: the data-aware budget's scores per cost."""
        if self.truncation.frozen(augmentation):
            return {n: min(self.layers[n].rank, s.numel()) for n, s in spectra.items()}
        buf = self.count_buffer
        fixed = self.other_params + sum(layer_cost(m.out_features, m.in_features, m.rank, buffer=buf)
                                        for n, m in self.layers.items() if n not in spectra)
        shapes = {n: (self.layers[n].out_features, self.layers[n].in_features) for n in spectra}
        caps = {n: self.rank_cap(self.layers[n]) for n in spectra}
        return self.truncation.allocate(spectra, shapes, self.now(augmentation, start) - fixed,
                                        min_rank=self.min_rank, max_ranks=caps, buffer=buf, scores=scores)
