"""Checkpoint-spacing and rank controllers driven by the reversal defect δ and ρ = σ_min/σ_max."""

from __future__ import annotations

import abc
from dataclasses import dataclass

import torch


class AbstractController(abc.ABC):
    """Decides, per block of the forward pass: the spacing C of the next checkpoint, how much
    to grow the rank, and (in the backward pass) whether to reload a checkpoint instead of
    reversing. Called by the ODE block in that order."""

    @abc.abstractmethod
    def initial_spacing(self, previous: int | None = None) -> int:
        """Spacing of a forward pass's first segment; ``previous`` is the spacing the last
        forward pass ended with (None on the first)."""

    @abc.abstractmethod
    def next_spacing(self, c: int, delta: float) -> int: ...

    @abc.abstractmethod
    def rank_increase(self, rank: int, delta: float, rho: float) -> int: ...

    @abc.abstractmethod
    def reload(self, local_delta: float) -> bool: ...

    def learns_from_replays(self) -> bool:
        """Should the block shorten segments where its backward had to replay (and lengthen
        them again where it did not)? Default: no."""
        return False

    def reads_defect(self) -> bool:
        """Do the spacing and rank rules read δ? If not, the forward pass measures δ (one
        reverse of a segment's last step, several forward steps of work) on its first segment
        only, as a sample for the statistics. Default: yes, on every segment."""
        return True

    def plan(self, steps: int, state_bytes: int) -> tuple[list[int], list[int]] | None:
        """A schedule fixed before the forward pass: segment lengths and, per segment, the
        states a replay of it may hold (binomial replay). Default None: the spacing rules
        above decide as the pass goes, and a replay holds its whole segment."""
        del steps, state_bytes
        return None


@dataclass(frozen=True)
class FixedController(AbstractController):
    """The baseline: checkpoint every ``c`` steps, rank fixed at ``rank``, never reload."""

    c: int
    rank: int

    def __post_init__(self) -> None:
        if self.c < 1 or self.rank < 1:
            raise ValueError(f"need c >= 1 and rank >= 1; got c={self.c}, rank={self.rank}")

    def initial_spacing(self, previous: int | None = None) -> int:
        del previous
        return self.c

    def next_spacing(self, c: int, delta: float) -> int:
        del delta
        return self.c

    def rank_increase(self, rank: int, delta: float, rho: float) -> int:
        del rank, delta, rho
        return 0

    def reload(self, local_delta: float) -> bool:
        del local_delta
        return False

    def reads_defect(self) -> bool:
        return False


@dataclass(frozen=True)
class DefectController(AbstractController):
    r"""The seed's rules:

    - C ← max(1, ⌊C/2⌋) if δ > τ_warn; C ← min(C_max, C + 1) if δ < τ_safe; else unchanged;
    - r ← min(max_rank, r + Δr) if δ > τ_rank or ρ < τ_svd;
    - reload a checkpoint in the backward pass when the local defect exceeds τ_grad.

    With ``carry=True`` each forward pass starts from the spacing the previous one reached
    instead of ``c_init`` (our tuning: the seed restarts at C_init, so with its +1 growth a
    64-step pass stores ⌈64/C⌉-ish checkpoints forever; carried over, C reaches C_max after a
    few iterations when δ stays small, and halves again as soon as it does not).

    With ``replay_aware=True`` the block also remembers, step by step, where its backward had to
    replay a segment (local defect > τ_grad): the next forward caps the segments there at half
    the replayed length, and doubles the cap where the replay was not needed (our second
    tuning: δ is probed only at segment ends, on the product, and does not see the factor
    drift that forces replays, while the replayed segment's C states set the peak memory).

    With exact substep inverses δ sits at the dtype's roundoff, so thresholds must be set
    relative to it (:meth:`for_dtype`), or C never grows.
    """

    tau_warn: float
    tau_safe: float
    tau_rank: float
    tau_svd: float
    tau_grad: float
    c_init: int = 8
    c_max: int = 32
    delta_r: int = 2
    max_rank: int = 32
    carry: bool = False
    replay_aware: bool = False

    def __post_init__(self) -> None:
        if not 0 < self.tau_safe <= self.tau_warn:
            raise ValueError(f"need 0 < tau_safe <= tau_warn; got {self.tau_safe}, {self.tau_warn}")
        if min(self.tau_rank, self.tau_grad) <= 0 or not 0 <= self.tau_svd < 1:
            raise ValueError("tau_rank and tau_grad must be > 0 and tau_svd in [0, 1)")
        if not 1 <= self.c_init <= self.c_max or self.delta_r < 1 or self.max_rank < 1:
            raise ValueError(f"need 1 <= c_init <= c_max, delta_r >= 1, max_rank >= 1; got "
                             f"{self.c_init}, {self.c_max}, {self.delta_r}, {self.max_rank}")

    @classmethod
    def for_dtype(cls, dtype: torch.dtype, **overrides) -> DefectController:
        """Thresholds as multiples of the dtype's eps: τ_safe = 1e2·eps, τ_warn = 1e4·eps,
        τ_rank = 1e5·eps, τ_grad = 1e6·eps, τ_svd = 1e3·eps (ρ floor)."""
        eps = torch.finfo(dtype).eps
        kw = dict(tau_safe=1e2 * eps, tau_warn=1e4 * eps, tau_rank=1e5 * eps,
                  tau_grad=1e6 * eps, tau_svd=1e3 * eps)
        kw.update(overrides)
        return cls(**kw)

    def initial_spacing(self, previous: int | None = None) -> int:
        return previous if self.carry and previous is not None else self.c_init

    def next_spacing(self, c: int, delta: float) -> int:
        if not delta <= self.tau_warn:  # a NaN defect counts as a failed reversal
            return max(1, c // 2)
        if delta < self.tau_safe:
            return min(self.c_max, c + 1)
        return c

    def rank_increase(self, rank: int, delta: float, rho: float) -> int:
        if not (delta <= self.tau_rank and rho >= self.tau_svd):  # NaN triggers
            return max(0, min(self.delta_r, self.max_rank - rank))
        return 0

    def reload(self, local_delta: float) -> bool:
        return not local_delta <= self.tau_grad

    def learns_from_replays(self) -> bool:
        return self.replay_aware


@dataclass(frozen=True)
class MemoryBudget(AbstractController):
    """Keep the reversal backward's tape — checkpoints, plus the states a replay holds — under
    ``max_bytes``, or under ``max_states`` states (give one), recomputing as few steps as
    possible where a segment must be replayed.

    A budget in bytes holds ⌊max_bytes / state bytes⌋ states, so a smaller batch (the last of
    an epoch) gets more of them; a budget in states holds the same count for every batch.
    With S = (states held) − 1 slots besides the input state, the forward pass
    stores checkpoints where :func:`rankwise.ode._revolve.plan` puts them (the optimum of the
    binomial recurrence when the forward sweep is free: revolve's optimum for the same
    budget), and a replayed segment j uses the S − j slots its right neighbours freed. Where
    the reverse is reliable nothing is recomputed; a segment is replayed where the local defect
    exceeds `tau_grad` (None: only the block's own safety net, 1e4·eps). The rank is fixed (no
    enrichment: the budget counts states of one size)."""

    max_bytes: int | None = None
    tau_grad: float | None = None
    max_states: int | None = None

    def __post_init__(self) -> None:
        if (self.max_bytes is None) == (self.max_states is None):
            raise ValueError("MemoryBudget takes exactly one of `max_bytes` and `max_states`; got "
                             f"max_bytes={self.max_bytes!r}, max_states={self.max_states!r}")
        for name in ("max_bytes", "max_states"):
            v = getattr(self, name)
            if v is not None and (not isinstance(v, int) or isinstance(v, bool) or v < 1):
                raise ValueError(f"`{name}` must be a positive int; got {v!r}")
        if self.tau_grad is not None and not self.tau_grad > 0:
            raise ValueError(f"`tau_grad` must be > 0 or None; got {self.tau_grad}")

    def plan(self, steps: int, state_bytes: int) -> tuple[list[int], list[int]]:
        from ._revolve import plan

        slots = self.max_states if self.max_bytes is None else self.max_bytes // state_bytes
        if slots < 1:
            raise ValueError(f"MemoryBudget(max_bytes={self.max_bytes}) holds no state of {state_bytes} "
                             "bytes (the input state alone must fit)")
        lengths = plan(steps, slots - 1)
        return lengths, [slots - 1 - j for j in range(len(lengths))]

    def initial_spacing(self, previous: int | None = None) -> int:
        del previous
        return 1  # (unused: plan() decides)

    def next_spacing(self, c: int, delta: float) -> int:
        del delta
        return c

    def rank_increase(self, rank: int, delta: float, rho: float) -> int:
        del rank, delta, rho
        return 0

    def reload(self, local_delta: float) -> bool:
        return self.tau_grad is not None and not local_delta <= self.tau_grad

    def reads_defect(self) -> bool:
        return False  # (the reverse's cost, which the plan's choices read, is measured once)
