"""The settings of one `rankwise ode` run (:class:`OdeRunConfig`); torch-free, so that the command
line takes its options from it and checks them before importing torch."""

from __future__ import annotations

from dataclasses import dataclass

from .._checks import check_training
from .._fields import setting

CONTROLLERS = ("fixed", "adaptive", "replay", "budget", "autograd", "gru")
RECURRENCES = ("kron", "full")  # = rankwise.ode._gated.RECURRENCES (tested): A c Bᵀ, or U vec(c)


@dataclass(frozen=True)
class OdeRunConfig:
    """One training run. ``controller``: "fixed" (spacing ``c``, rank ``rank``), "adaptive"
    (:meth:`DefectController.for_dtype` for float32 with ``c_init=c``, ``max_rank``, carry-over),
    "replay" (the same, replay-aware), "budget" (:class:`MemoryBudget` of ``budget_states``
    states, rank ``rank``; ``budget_in="bytes"``: the bytes of that many states of the first
    batch's size) or "autograd" (the baseline: no reversal,
    plain autograd through the stored graph at rank ``rank``; its memory is the bytes of the
    tensors the graph saves, counted with saved-tensor hooks).

    ``model``: "gated" (:class:`SequenceClassifier` with ``p``, ``window``, ``position_weights``,
    step ``h``; Adam with a one-cycle schedule peaking at ``lr``) or "layered"
    (:class:`LayeredMemoryODE` with ``layers``, ``depth_steps``; constant ``lr``). ``lr=None``:
    3e-3 (gated) or 1e-2 (layered). ``position_weights=None``: on for permuted digits (positions
    carry no order), off for mnist1d (one input map for all steps: the pattern may sit anywhere).
    ``controller="gru"``: not an ODE at all but the recurrent baseline :class:`GRUClassifier`
    with ``gru_hidden`` units, trained by the same protocol (optimizer, schedule, batches,
    clipping; its memory counted as the autograd baseline's).
    ``recurrence`` (gated): how the gates read the core, ``"kron"`` (A c Bᵀ) or ``"full"``
    (U vec(c), p⁴ numbers per gate). ``causal`` (gated): each step's S-substep at its start,
    so step i reads elements ≤ i only;
    ``False``: the textbook step (S-substep at t + h, one element ahead). The layered model
    always uses the textbook step. ``validation`` (in [0, 1)): train on the first 1 − v of the
    training set and report ``val_acc`` on the rest instead of ``test_acc`` (the test set is not
    read: for choosing a setting)."""

    data: str = setting("digits", help="digits (permuted, 64 steps) or mnist1d (40 steps).")
    model: str = setting("gated", help="gated (a GRU-ODE on the memory's core, one block) or layered (the "
                                       "first study's 6-layer model).")
    controller: str = "fixed"
    c: int = 8
    rank: int = setting(8, help="Initial rank of every layer (adaptive may grow it).")
    max_rank: int = setting(32, help="Adaptive rank cap.")
    c_max: int = setting(32, help="Adaptive spacing cap, unless an entry gives -CMAX.")
    layers: int = setting(6, help="Layered model: ODE layers (1 reads the sequence, the rest are depth).")
    depth_steps: int = setting(8, help="Layered model: steps of each depth block.")
    m: int = 32
    p: int = 16
    window: int = 3
    position_weights: bool | None = None
    h: float = 0.25
    budget_states: int = 12
    budget_in: str = setting("states", help="budget:STATES counts states (the same for every batch) or "
                                            "bytes (STATES states of the first batch: a smaller batch gets "
                                            "more).")
    epochs: int = setting(1, help="Training epochs per run.")
    lr: float | None = None
    batch_size: int = 64
    seed: int = 0
    causal: bool = setting(True, flag="--causal/--no-causal",
                           help="Gated model: each KSL step's S-substep at its start, so step i reads "
                           "elements <= i (--no-causal: at t + h, one element ahead).")
    gru_hidden: int = 128
    recurrence: str = setting("kron", help="Gated model: how the gates read the memory's core: kron (A c "
                                           "Bᵀ, 2p² numbers per gate) or full (U vec(c), p⁴ per gate, as a "
                                           "GRU of p² units).")
    validation: float = setting(0.0, help="Hold out this last fraction of the training set and report "
                                          "accuracy on it (val acc) instead of on the test set, which is "
                                          "then not read: for choosing a setting.")

    def __post_init__(self) -> None:
        if self.data not in ("digits", "mnist1d"):
            raise ValueError(f"`data` must be 'digits' or 'mnist1d'; got {self.data!r}")
        if self.recurrence not in RECURRENCES:
            raise ValueError(f"`recurrence` must be one of {', '.join(map(repr, RECURRENCES))}; "
                             f"got {self.recurrence!r}")
        if self.budget_in not in ("states", "bytes"):
            raise ValueError(f"`budget_in` must be 'states' or 'bytes'; got {self.budget_in!r}")
        if self.model not in ("gated", "layered"):
            raise ValueError(f"`model` must be 'gated' or 'layered'; got {self.model!r}")
        if self.controller not in CONTROLLERS:
            raise ValueError(f"`controller` must be one of {', '.join(CONTROLLERS)}; got {self.controller!r}")
        check_training(epochs=self.epochs, batch_size=self.batch_size, lr=self.learning_rate, seed=self.seed)
        if not self.h > 0:
            raise ValueError(f"`h` must be > 0; got {self.h}")
        if not 0 <= self.validation < 1:
            raise ValueError(f"`validation` must be in [0, 1) (a fraction of the training set); "
                             f"got {self.validation}")
        if self.model == "gated" and not 1 <= self.p <= self.m:
            raise ValueError(f"`p` must be in [1, m={self.m}]; got {self.p}")
        for name in ("c", "rank", "layers", "depth_steps", "window", "budget_states", "gru_hidden"):
            if getattr(self, name) < 1:
                raise ValueError(f"`{name}` must be >= 1; got {getattr(self, name)}")
        if not 1 <= self.rank <= self.m:
            raise ValueError(f"`rank` must be in [1, m={self.m}] (the memory is {self.m}×{self.m}); "
                             f"got {self.rank}")
        if self.controller in ("adaptive", "replay") and not self.rank <= self.max_rank <= self.m:
            raise ValueError(f"`max_rank` must be in [rank={self.rank}, m={self.m}]; got {self.max_rank}")
        if self.controller in ("adaptive", "replay") and self.c_max < self.c:
            raise ValueError(f"`c_max` must be >= c={self.c}; got {self.c_max}")

    @property
    def learning_rate(self) -> float:
        if self.lr is not None:
            return self.lr
        return 3e-3 if self.model == "gated" else 1e-2

    @property
    def name(self) -> str:
        full = self.model == "gated" and self.recurrence == "full" and self.controller != "gru"
        val = f", validation {self.validation:g}" if self.validation else ""
        return self._name + (", full recurrence" if full else "") + val

    @property
    def _name(self) -> str:
        if self.controller == "fixed":
            return f"fixed C={self.c} r={self.rank}"
        if self.controller == "budget":
            return f"budget {self.budget_states} states r={self.rank}"
        if self.controller == "autograd":
            return f"autograd r={self.rank}"
        if self.controller == "gru":
            return f"GRU h={self.gru_hidden}"
        kind = "adaptive" if self.controller == "adaptive" else "replay-aware"
        return f"{kind} C={self.c}→{self.c_max} r={self.rank}→{self.max_rank}"


