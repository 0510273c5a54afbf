"""LowRankODEBlock: a low-rank matrix ODE layer trained by reversal instead of a stored graph.

This module is the layer and its forward schedule; the reverse pass is :mod:`._backward`, the
frame and defect math :mod:`._frames`, the tape :mod:`._tape`, the gradient audit :mod:`._audit`.

The forward pass keeps one factor checkpoint per segment of C steps (C set by the controller
from the reversal defect δ of each segment's last step; a controller whose rules do not read δ
gets it measured on the first segment only) and the enrichment events, nothing per
step. The backward pass walks the steps in reverse: it reconstructs each state with
:func:`ksl_reverse`, recomputes that one step with autograd for its vector-Jacobian product, and
replays the segment forward from its checkpoint whenever the local defect exceeds the
controller's τ_grad. Enrichment is replayed with the same random seed; its new directions are
treated as constants (like a pivot choice).

**Gauge.** A reconstructed state has the right product F but factors in other bases than the
forward's (each QR picks a frame). Everything downstream depends on the factors only through F
and the spans of X and V (KSL is equivariant under X → XQ₁, S → Q₁ᵀSQ₂, V → VQ₂), so the
cotangent is carried across frames exactly by the r×r rotations Rx = X_gᵀX, Rv = V_gᵀV between
the frame the cotangent is expressed in and the recomputed one. Where the core is numerically
singular the spans are not determined by F, Rx stops being orthogonal, the aligned factors
disagree, and the segment is replayed from its checkpoint instead.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor, nn

from ._backward import _Reversal
from ._controller import AbstractController
from ._enrich import enrich
from ._field import BoundField, FactoredField
from ._frames import _rel
from ._implicit import SOLVERS
from ._ksl import Field, _step, ksl_reverse, rank_ratio, s_substep_time
from ._state import LowRankState
from ._tape import OdeSolution, Tape, _nbytes, tape_bytes


class _Counted(BoundField):
    """The block's field, counting its evaluations (dense calls and factored projections)."""

    def __init__(self, field: nn.Module) -> None:
        super().__init__()
        self.calls, self._inner = 0, [field]  # (a list: not registered as a submodule)
        self._factored = isinstance(field, FactoredField)

    def forward(self, t: float, F: Tensor) -> Tensor:
        self.calls += 1
        return self._inner[0](t, F)

    def _counting(self, bound: Callable[[Tensor], Tensor]) -> Callable[[Tensor], Tensor]:
        def call(a: Tensor) -> Tensor:
            self.calls += 1
            return bound(a)
        return call

    def bind_right(self, t: float, V: Tensor) -> Callable[[Tensor], Tensor]:
        if not self._factored:
            return lambda K: self(t, K @ V.mT) @ V
        return self._counting(self._inner[0].bind_right(t, V))

    def bind_left(self, t: float, X: Tensor) -> Callable[[Tensor], Tensor]:
        if not self._factored:
            return lambda L: self(t, X @ L.mT).mT @ X
        return self._counting(self._inner[0].bind_left(t, X))

    def bind_project(self, t: float, X: Tensor, V: Tensor) -> Callable[[Tensor], Tensor]:
        if not self._factored:
            return lambda S: X.mT @ self(t, X @ S @ V.mT) @ V
        return self._counting(self._inner[0].bind_project(t, X, V))


class LowRankODEBlock(nn.Module):
    """Integrate dF/dt = field(t, F) for ``steps`` KSL steps of size ``h``, with reversal
    backprop.

    **Arguments:**
    - `field`: an ``nn.Module`` called as ``field(t, F)``, F (B, m, n); its parameters learn.
    - `rank`: rank of the state built from a dense input; `steps`, `h`: the time grid.
    - `controller`: :class:`DefectController` or :class:`FixedController`.
    - `reversible`: ``False`` integrates with plain autograd through the whole stored graph,
      at the initial spacing and rank (no adaptive decisions); :func:`audit_gradients` makes it
      replay the schedule of the last reversible forward.
    - `alpha`: diagonal value given to enriched directions; `seed`: enrichment seeds.
    - `s_time`: where each step evaluates its S-substep: ``"end"`` (t + h, the textbook
      ordering) or ``"start"`` (t: causal for a field driven by a piecewise-constant input,
      step i reads element i only). See :mod:`._ksl`.
    - `solver`: how the reverse solves its implicit substeps: ``"picard"`` (plain fixed point)
      or ``"anderson"`` (Anderson-accelerated: fewer field evaluations, but slower in time at
      the sizes measured in docs/ode.md). See :mod:`._implicit`.

    ``solve(state)`` takes a :class:`LowRankState` or a dense (B, m, n) tensor and returns an
    :class:`OdeSolution` (the final state, the tape, the statistics, which its backward pass
    completes); ``forward(state)`` returns ``solve(state).state``. The last reversible pass's
    solution is ``last_solution`` (``last_stats`` and ``last_tape`` read it).
    """

    def __init__(self, field: nn.Module, *, rank: int, steps: int, h: float,
                 controller: AbstractController, reversible: bool = True, alpha: float = 1e-3,
                 seed: int = 0, s_time: str = "end", solver: str = "picard") -> None:
        super().__init__()
        if rank < 1 or steps < 1 or not h > 0:
            raise ValueError(f"need rank >= 1, steps >= 1, h > 0; got {rank}, {steps}, {h}")
        s_substep_time(0.0, h, s_time)  # (names a bad s_time)
        if solver not in SOLVERS:
            raise ValueError(f"`solver` must be one of {', '.join(map(repr, SOLVERS))}; got {solver!r}")
        self.field, self.rank, self.steps, self.h, self.s_time = field, rank, steps, h, s_time
        self.solver = solver
        self.controller, self.reversible, self.alpha, self.seed = controller, reversible, alpha, seed
        self.last_solution: OdeSolution | None = None  # of the last reversible forward
        self._replay: Tape | None = None
        self._spacing: int | None = None  # where the last recorded forward left C
        self._caps: dict[int, int] = {}  # step -> longest segment allowed over it (replay-aware)

    def step(self, state: LowRankState, i: int, field: Field | None = None) -> LowRankState:
        """Step i (from t = i·h) of the block's integrator; `field` defaults to the block's."""
        return _step(state, self.field if field is None else field, i * self.h, self.h, self.s_time)[0]

    def reverse(self, state: LowRankState, i: int, field: Field | None = None) -> LowRankState:
        """The exact inverse of :meth:`step` i (factors in rotated bases)."""
        return ksl_reverse(state, self.field if field is None else field, i * self.h, self.h,
                           s_time=self.s_time, solver=self.solver)

    def apply_enrichment(self, state: LowRankState, i: int, event: tuple[int, int]) -> LowRankState:
        """The enrichment ``event = (delta_r, seed)`` at step i, deterministic (replayed by the
        backward with the same seed); new directions computed without gradient (constants)."""
        with torch.no_grad():
            g = torch.Generator(device=state.X.device).manual_seed(event[1])
            d = LowRankState(state.X.detach(), state.S.detach(), state.V.detach())
            new = enrich(d, self.field, i * self.h, event[0], alpha=self.alpha, generator=g)
        r = state.rank
        S = torch.zeros_like(new.S)
        S[:, :r, :r] = state.S
        S = S + torch.nn.functional.pad(new.S[:, r:, r:], (r, 0, r, 0))
        return LowRankState(torch.cat([state.X, new.X[..., r:]], -1), S,
                            torch.cat([state.V, new.V[..., r:]], -1))

    def run(self, state: LowRankState, *, record: Tape | None = None,
            replay: Tape | None = None) -> LowRankState:
        """Integrate all steps. ``record``: choose the schedule with the controller and record
        it (checkpoints, events, stats). ``replay``: follow a recorded schedule."""
        ctl, i, seg = self.controller, 0, 0
        c = ctl.initial_spacing(self._spacing if replay is None else None)
        deltas, rhos, reverse_cost = [], [], 0.0
        planned = ctl.plan(self.steps, _nbytes(state)) if record is not None else None
        while i < self.steps:
            if replay is not None:
                length, event = replay.lengths[seg], replay.enrichments[seg]
            elif planned is not None:  # a memory budget: positions and replay slots fixed up front
                length, event = planned[0][seg], None
                record.starts.append(i)
                record.lengths.append(length)
                record.checkpoints.append(state)
                record.enrichments.append(None)
                record.replay_slots.append(planned[1][seg])
            else:
                length, event = min(c, self.steps - i), None
                if record is not None:
                    length = min([length, *(self._caps[k] for k in range(i, i + length) if k in self._caps)])
                    rho = float(rank_ratio(state).min())
                    room = min(state.X.shape[1], state.V.shape[1]) - state.rank
                    grow = min(ctl.rank_increase(state.rank, deltas[-1] if deltas else 0.0, rho), room)
                    event = (grow, self.seed * 100003 + seg) if grow > 0 else None
                    record.starts.append(i)
                    record.lengths.append(length)
                    record.checkpoints.append(state)
                    record.enrichments.append(event)
                    record.replay_slots.append(None)
            if event is not None:
                state = self.apply_enrichment(state, i, event)
            for j in range(length):
                prev = state
                state = self.step(state, i + j)
            if record is not None and (seg == 0 or ctl.reads_defect()):  # δ of the segment's last
                last = i + length - 1  # step drives the controller (or, once, samples it)
                counted = _Counted(self.field) if planned is not None else self.field
                back = self.reverse(state, last, counted)
                if planned is not None:  # what a reversed step costs, in forward steps (a budget's choice)
                    rev_calls = counted.calls
                    self.step(prev, last, counted)  # (the step again: its field evaluations)
                    reverse_cost = max(reverse_cost, rev_calls / max(1, counted.calls - rev_calls))
                deltas.append(_rel(back, prev))
                c = ctl.next_spacing(c, deltas[-1])
            if record is not None:
                rhos.append(float(rank_ratio(state).min()))
            i += length
            seg += 1
        if record is not None:
            self._spacing = c
            record.stats = dict(rank=state.rank, checkpoints=len(record.checkpoints), spacing=c,
                                max_delta=max(deltas), mean_delta=sum(deltas) / len(deltas),
                                min_rho=min(rhos), tape_bytes=tape_bytes(record),
                                reverse_cost=reverse_cost)
        return state

    @property
    def last_stats(self) -> dict:
        """The statistics of the last reversible pass (empty before the first)."""
        return self.last_solution.stats if self.last_solution is not None else {}

    @property
    def last_tape(self) -> Tape | None:
        return self.last_solution.tape if self.last_solution is not None else None

    def _learn_from_replays(self) -> None:
        """Replay-aware caps (the controller's choice): halve the segments over steps where the
        last backward had to replay, relax them where it did not."""
        tape = self.last_tape
        if tape is None or tape.learned or not tape.replayed or not self.controller.learns_from_replays():
            return
        caps = self._caps
        for i0, n, replayed in zip(tape.starts, tape.lengths, tape.replayed, strict=True):
            caps.update({k: max(1, n // 2) if replayed else 2 * caps[k]
                         for k in range(i0, i0 + n) if replayed or k in caps})
        tape.learned = True

    def solve(self, state: LowRankState | Tensor) -> OdeSolution:
        """Integrate from `state` -> :class:`OdeSolution`."""
        if isinstance(state, Tensor):
            state = LowRankState.from_dense(state, self.rank)
        if not self.reversible:  # plain autograd; the schedule only matters for reversal, so
            # no adaptive decisions are taken unless a recorded one is replayed (the audit)
            return OdeSolution(self.run(state, replay=self._replay), None, {})
        self._learn_from_replays()
        params = [p for p in self.field.parameters() if p.requires_grad]
        tape = Tape()
        X, S, V = _Reversal.apply(self, tape, state.X, state.S, state.V, *params)
        self.last_solution = OdeSolution(LowRankState(X, S, V), tape, tape.stats)
        return self.last_solution

    def forward(self, state: LowRankState | Tensor) -> LowRankState:
        return self.solve(state).state
