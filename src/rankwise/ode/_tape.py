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
    stats: dict = dc_field(default_factory=dict)


def _eps(st: LowRankState) -> float:
    return torch.finfo(st.S.dtype).eps


def _nbytes(st: LowRankState) -> int:
    return st.X.nbytes + st.S.nbytes + st.V.nbytes


def tape_bytes(tape: Tape) -> int:
    """Bytes the reversal backward keeps between forward and backward: the checkpoints (those
    the backward has not freed yet)."""
    return sum(_nbytes(cp) for cp in tape.checkpoints if cp is not None)
