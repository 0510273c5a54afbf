"""The forward schedule a reversal backward walks: segments, checkpoints, enrichment events."""

from __future__ import annotations

from dataclasses import dataclass
from dataclasses import field as dc_field

import torch

from ._state import LowRankState


@dataclass
class Tape:
    """The forward schedule: per segment its first step, length, checkpoint (before
    enrichment) and enrichment ``(delta_r, seed)`` or None."""

    starts: list[int] = dc_field(default_factory=list)
    lengths: list[int] = dc_field(default_factory=list)
    checkpoints: list[LowRankState | None] = dc_field(default_factory=list)  # None: freed by backward
    enrichments: list[tuple[int, int] | None] = dc_field(default_factory=list)
    replay_slots: list[int | None] = dc_field(default_factory=list)  # binomial replay (None: store all)
    stats: dict = dc_field(default_factory=dict)  # forward figures; the backward adds its own
    replayed: list[bool] = dc_field(default_factory=list)  # per segment, filled by the backward
    learned: bool = False  # have the replay-aware caps taken `replayed` into account?


@dataclass
class OdeSolution:
    """What one forward pass of a :class:`~rankwise.ode.LowRankODEBlock` produced (its
    ``solve``): the final ``state``, the recorded ``tape`` (None for a non-reversible pass) and
    its ``stats`` — rank, checkpoints, spacing, max/mean δ, min ρ, tape bytes — to which the
    backward pass adds ``reloads``, ``replay_bytes``, ``recomputed``, ``peak_tape_bytes`` and
    ``replayed_by_cost`` (the same dict, updated in place)."""

    state: LowRankState
    tape: Tape | None
    stats: dict


def _eps(st: LowRankState) -> float:
    return torch.finfo(st.S.dtype).eps


def _nbytes(st: LowRankState) -> int:
    return st.X.nbytes + st.S.nbytes + st.V.nbytes


def tape_bytes(tape: Tape) -> int:
    """Bytes the reversal backward keeps between forward and backward: the checkpoints (those
    the backward has not freed yet)."""
    return sum(_nbytes(cp) for cp in tape.checkpoints if cp is not None)
