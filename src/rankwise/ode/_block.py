"""LowRankODEBlock: a low-rank matrix ODE layer trained by reversal instead of a stored graph.

The forward pass keeps one factor checkpoint per segment of C steps (C set by the controller
from the reversal defect δ of each segment's last step) and the enrichment events, nothing per
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

import logging
from collections.abc import Callable
from dataclasses import dataclass
from dataclasses import field as dc_field

import torch
from torch import Tensor, nn

from ._controller import AbstractController
from ._enrich import enrich
from ._field import FactoredField
from ._ksl import _step, ksl_reverse, rank_ratio, relative_error
from ._revolve import recompute_cost, split
from ._state import LowRankState

log = logging.getLogger(__name__)


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


_SAFE = 1e4  # local defect (in units of eps) above which the backward always replays


def _eps(st: LowRankState) -> float:
    return torch.finfo(st.S.dtype).eps


def _nbytes(st: LowRankState) -> int:
    return st.X.nbytes + st.S.nbytes + st.V.nbytes


def tape_bytes(tape: Tape) -> int:
    """Bytes the reversal backward keeps between forward and backward: the checkpoints (those
    the backward has not freed yet)."""
    return sum(_nbytes(cp) for cp in tape.checkpoints if cp is not None)


def _rel(a: LowRankState, b: LowRankState) -> float:
    return float(relative_error(a, b).max())


def _rel_factors(a: LowRankState, b: LowRankState) -> float:
    """Largest relative difference of the factors X, S, V (not only of the product: with an
    ill-conditioned core the product can be right while the factors are rotated)."""
    tiny = torch.finfo(b.S.dtype).tiny
    return max(float((torch.linalg.matrix_norm(x - y) / (torch.linalg.matrix_norm(y) + tiny)).max())
               for x, y in ((a.X, b.X), (a.S, b.S), (a.V, b.V)))


class _Counted(FactoredField):
    """The block's field, counting its evaluations (dense calls and factored projections)."""

    def __init__(self, field: nn.Module) -> None:
        super().__init__()
        self.calls, self._inner = 0, [field]  # (a list: not registered as a submodule)
        self._factored = isinstance(field, FactoredField)

    def forward(self, t: float, F: Tensor) -> Tensor:
        self.calls += 1
        return self._inner[0](t, F)

    def apply_right(self, t: float, K: Tensor, V: Tensor) -> Tensor:
        if not self._factored:
            return self(t, K @ V.mT) @ V
        self.calls += 1
        return self._inner[0].apply_right(t, K, V)

    def apply_left(self, t: float, X: Tensor, L: Tensor) -> Tensor:
        if not self._factored:
            return self(t, X @ L.mT).mT @ X
        self.calls += 1
        return self._inner[0].apply_left(t, X, L)

    def project(self, t: float, X: Tensor, S: Tensor, V: Tensor) -> Tensor:
        if not self._factored:
            return X.mT @ self(t, X @ S @ V.mT) @ V
        self.calls += 1
        return self._inner[0].project(t, X, S, V)


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

    ``forward(state)`` takes a :class:`LowRankState` or a dense (B, m, n) tensor and returns the
    final :class:`LowRankState`. ``last_stats``: rank, checkpoints stored, max/mean δ, min ρ
    (after a backward pass also ``reloads``, segments replayed from their checkpoint, and
    ``replay_bytes``, the largest replayed segment's states held at once).
    """

    def __init__(self, field: nn.Module, *, rank: int, steps: int, h: float,
                 controller: AbstractController, reversible: bool = True, alpha: float = 1e-3,
                 seed: int = 0) -> None:
        super().__init__()
        if rank < 1 or steps < 1 or not h > 0:
            raise ValueError(f"need rank >= 1, steps >= 1, h > 0; got {rank}, {steps}, {h}")
        self.field, self.rank, self.steps, self.h = field, rank, steps, h
        self.controller, self.reversible, self.alpha, self.seed = controller, reversible, alpha, seed
        self.last_stats: dict = {}
        self.last_tape: Tape | None = None
        self._replay: Tape | None = None
        self._spacing: int | None = None  # where the last recorded forward left C
        self._caps: dict[int, int] = {}  # step -> longest segment allowed over it (replay-aware)

    def _enrich(self, state: LowRankState, i: int, event: tuple[int, int]) -> LowRankState:
        """Deterministic enrichment; new directions computed without gradient (constants)."""
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
                state = self._enrich(state, i, event)
            for j in range(length):
                prev = state
                state = _step(state, self.field, (i + j) * self.h, self.h)[0]
            if record is not None:  # δ of the segment's last step drives the controller
                t_last = (i + length - 1) * self.h
                counted = _Counted(self.field) if planned is not None else self.field
                back = ksl_reverse(state, counted, t_last, self.h)
                if planned is not None:  # what a reversed step costs, in forward steps (a budget's choice)
                    rev_calls = counted.calls
                    _step(prev, counted, t_last, self.h)  # (the step again: its field evaluations)
                    reverse_cost = max(reverse_cost, rev_calls / max(1, counted.calls - rev_calls))
                deltas.append(_rel(back, prev))
                rhos.append(float(rank_ratio(state).min()))
                c = ctl.next_spacing(c, deltas[-1])
            i += length
            seg += 1
        if record is not None:
            self._spacing = c
            record.stats = dict(rank=state.rank, checkpoints=len(record.checkpoints), spacing=c,
                                max_delta=max(deltas), mean_delta=sum(deltas) / len(deltas),
                                min_rho=min(rhos), tape_bytes=tape_bytes(record),
                                reverse_cost=reverse_cost)
        return state

    def forward(self, state: LowRankState | Tensor) -> LowRankState:
        if isinstance(state, Tensor):
            state = LowRankState.from_dense(state, self.rank)
        if not self.reversible:  # plain autograd; the schedule only matters for reversal, so
            # no adaptive decisions are taken unless a recorded one is replayed (the audit)
            return self.run(state, replay=self._replay)
        params = [p for p in self.field.parameters() if p.requires_grad]
        X, S, V = _Reversal.apply(self, state.X, state.S, state.V, *params)
        return LowRankState(X, S, V)


def _frame_invariant(st: LowRankState, g: tuple[Tensor | None, ...]) -> bool:
    """Is the cotangent ``g`` of (X, S, V) blind to the factors' frame? A loss invariant under
    X → XQ₁, S → Q₁ᵀSQ₂, V → VQ₂ has skew(XᵀG_X − G_S Sᵀ) = 0 and skew(SᵀG_S + VᵀG_V) = 0."""
    gX, gS, gV = (torch.zeros_like(t) if x is None else x for t, x in zip((st.X, st.S, st.V), g, strict=True))
    a, b = st.X.mT @ gX, gS @ st.S.mT
    c, d = st.S.mT @ gS, st.V.mT @ gV
    tol = 1e3 * _eps(st)

    def skew_small(p: Tensor, q: Tensor) -> bool:
        m = p - q
        scale = torch.linalg.matrix_norm(p) + torch.linalg.matrix_norm(q) + torch.finfo(p.dtype).tiny
        return bool((torch.linalg.matrix_norm(m - m.mT) <= tol * scale).all())

    return skew_small(a, b) and skew_small(c, -d)


def _align(out: LowRankState, ref: LowRankState) -> tuple[Tensor, Tensor]:
    """Rotations (Rx, Rv), (B, r, r), taking ``ref``'s frame to ``out``'s: out.X ≈ ref.X Rx."""
    return ref.X.mT @ out.X, ref.V.mT @ out.V


def _vjp(fn: Callable[[LowRankState], LowRankState], state: LowRankState,
         g: tuple[Tensor | None, ...], params, ref: LowRankState | None = None):
    """Recompute ``fn(state)`` with autograd and pull back the cotangent ``g``.

    ``g`` is expressed in the frame of ``ref`` (default: the recomputed output's own). Returns
    (output, cotangents of X, S, V, param grads, local defect): the defect is the largest relative
    difference between the frame-aligned output factors and ``ref``'s (0 when ``ref`` is None).
    """
    X, S, V = (t.detach().requires_grad_(True) for t in (state.X, state.S, state.V))
    with torch.enable_grad():
        out = fn(LowRankState(X, S, V))
        local = 0.0
        if ref is not None:
            with torch.no_grad():
                o = LowRankState(out.X.detach(), out.S.detach(), out.V.detach())
                Rx, Rv = _align(o, ref)
                local = _rel_factors(LowRankState(o.X @ Rx.mT, Rx @ o.S @ Rv.mT, o.V @ Rv.mT), ref)
                gX, gS, gV = g
                g = (None if gX is None else gX @ Rx, None if gS is None else Rx.mT @ gS @ Rv,
                     None if gV is None else gV @ Rv)
        pairs = [(o, go) for o, go in zip((out.X, out.S, out.V), g, strict=True) if go is not None]
        grads = torch.autograd.grad([o for o, _ in pairs], [X, S, V, *params],
                                    [go for _, go in pairs], allow_unused=True)
    gin = tuple(torch.zeros_like(t) if gr is None else gr for t, gr in zip((X, S, V), grads[:3], strict=True))
    done = LowRankState(out.X.detach(), out.S.detach(), out.V.detach())
    return done, gin, grads[3:], local


class _Reversal(torch.autograd.Function):
    @staticmethod
    def forward(ctx, block: LowRankODEBlock, X, S, V, *params):
        tape = Tape()
        with torch.no_grad():
            out = block.run(LowRankState(X.detach(), S.detach(), V.detach()), record=tape)
        block.last_stats, block.last_tape = dict(tape.stats), tape
        log.info("LowRankODEBlock forward: %s", tape.stats)
        ctx.block, ctx.tape, ctx.out = block, tape, out
        return out.X, out.S, out.V

    @staticmethod
    def backward(ctx, gX, gS, gV):
        block, tape = ctx.block, ctx.tape
        params = [p for p in block.field.parameters() if p.requires_grad]
        pgrads = [torch.zeros_like(p) for p in params]
        h, f, ctl = block.h, block.field, block.controller
        cur, g = ctx.out, (gX, gS, gV)  # a segment's end state and cotangent, in the forward's frame
        reloads, replay_bytes, recomputed, by_cost = 0, 0, 0, 0
        budget = any(sl is not None for sl in tape.replay_slots)

        def stored() -> int:
            """Bytes of the states the backward keeps for later: the tape's checkpoints, and the
            end state of the segment being reversed once it has left the tape (not the output).
            Working states (at most two while one step is reversed or recomputed) are not
            counted, as revolve does not count its current state."""
            kept = tape_bytes(tape)
            if cur is not None and cur is not ctx.out and all(cur is not cp for cp in tape.checkpoints):
                kept += _nbytes(cur)
            return kept

        peak = stored()  # the checkpoints, plus what a replay holds on top
        # carrying g across QR frames is exact only if the loss does not see the frame (it
        # depends on F and the spans); otherwise every segment is replayed in the forward's frames
        frame_free = _frame_invariant(ctx.out, g)

        def add(acc, gp):
            for a, x in zip(acc, gp, strict=True):
                if x is not None:
                    a.add_(x)

        for seg in reversed(range(len(tape.starts))):
            i0, n = tape.starts[seg], tape.lengths[seg]
            cp, event = tape.checkpoints[seg], tape.enrichments[seg]
            if cp is None:
                raise RuntimeError("LowRankODEBlock under a MemoryBudget frees its checkpoints as its "
                                   "backward goes: backward through the same forward twice is not supported")
            with torch.no_grad():
                seg_start = block._enrich(cp, i0, event) if event is not None else cp
            seg_g = [torch.zeros_like(p) for p in params]
            c, gc, reversed_ok = cur, g, frame_free
            slots = tape.replay_slots[seg]
            # (a segment's first step starts from its checkpoint: n − 1 reverses)
            chose_replay = (slots is not None and n > 1 and reversed_ok
                            and recompute_cost(n, slots) < (n - 1) * tape.stats["reverse_cost"])
            if chose_replay:  # under a budget, replaying costs fewer field evaluations here
                reversed_ok = False
                by_cost += 1
            elif reversed_ok and n > 1:
                peak = max(peak, stored())
            for j in reversed(range(n) if reversed_ok else ()):  # reversal, in reconstructed frames
                i = i0 + j
                step = lambda st, i=i: _step(st, f, i * h, h)[0]  # noqa: E731
                with torch.no_grad():
                    prev = seg_start if j == 0 else ksl_reverse(c, f, i * h, h)
                gin, gp, local = _vjp(step, prev, gc, params, ref=c)[1:]
                # the controller's τ_grad, plus a safety net every controller gets: a reverse whose
                # fixed-point solve failed (h·Lip(field) ≥ 1) must not yield silent wrong gradients
                # (a one-step segment is computed from its checkpoint: nothing to check)
                if n > 1 and (ctl.reload(local) or not local <= _SAFE * _eps(c)):  # NaN fails too
                    reversed_ok = False
                    c = prev = None  # (not held through the replay that follows)
                    break
                add(seg_g, gp)
                c, gc = prev, gin
            if reversed_ok:
                add(pgrads, seg_g)
                g = gc
            elif slots is not None:  # replay within the budget: binomial
                reloads += not chose_replay  # (the reverse failed, or the loss sees the frames)
                cur = c = None  # a replay does not need the end state: its slot is free
                held = stored()
                g, extra, steps_done = _replay_binomial(seg_start, i0, n, slots, g, block, params, pgrads)
                recomputed += steps_done
                replay_bytes = max(replay_bytes, extra)
                peak = max(peak, held + extra)
            else:  # reversal drifted: replay the segment from its checkpoint, in the forward's
                reloads += 1  # own frames (g at the segment's end is expressed in them)
                with torch.no_grad():  # the segment's states, held only while it is processed
                    states = [seg_start]
                    for k in range(n - 1):
                        states.append(_step(states[-1], f, (i0 + k) * h, h)[0])
                recomputed += n - 1
                replay_bytes = max(replay_bytes, sum(_nbytes(st) for st in states))
                peak = max(peak, tape_bytes(tape) + sum(_nbytes(st) for st in states[1:]))
                for j in reversed(range(n)):
                    i = i0 + j
                    _, g, gp, _ = _vjp(lambda st, i=i: _step(st, f, i * h, h)[0], states[j], g, params)
                    add(pgrads, gp)
                del states
            if ctl.learns_from_replays():  # halve where a replay was needed, relax elsewhere
                caps = block._caps
                caps.update({k: max(1, n // 2) if not reversed_ok else 2 * caps[k]
                             for k in range(i0, i0 + n) if not reversed_ok or k in caps})
            if event is not None:
                _, g, gp, _ = _vjp(lambda st, i0=i0, ev=event: block._enrich(st, i0, ev), cp, g, params)
                add(pgrads, gp)
            cur = cp
            if budget:  # the next segment's slots come from here (other controllers keep the tape,
                tape.checkpoints[seg] = None  # so that a retained graph can run its backward again)
        block.last_stats = {**tape.stats, "reloads": reloads, "replay_bytes": replay_bytes,
                            "recomputed": recomputed, "peak_tape_bytes": peak, "replayed_by_cost": by_cost}
        return (None, *g, *pgrads)


def _replay_binomial(start: LowRankState, i0: int, n: int, slots: int, g, block: LowRankODEBlock,
                     params, pgrads) -> tuple[tuple, int, int]:
    """Backpropagate through steps i0…i0+n−1 from the stored state `start`, holding at most
    `slots` more states (the binomial schedule of :mod:`._revolve`). Accumulates the parameter
    gradients into `pgrads`; returns (cotangent at `start`, the most bytes held besides
    `start`, steps recomputed)."""
    f, h = block.field, block.h
    held: list[int] = []  # bytes of the states stored now
    most, steps = 0, 0

    def advance(st: LowRankState, i: int, k: int) -> LowRankState:
        nonlocal steps
        with torch.no_grad():
            for j in range(k):
                st = _step(st, f, (i + j) * h, h)[0]
        steps += k
        return st

    def sweep(st: LowRankState, i: int, k: int, s: int, g):
        nonlocal most
        if k == 1:
            _, g, gp, _ = _vjp(lambda x: _step(x, f, i * h, h)[0], st, g, params)
            for a, x in zip(pgrads, gp, strict=True):
                if x is not None:
                    a.add_(x)
            return g
        m = split(k, s) if s > 0 else 0
        if m == 0:  # no slot: reach every step from st
            for j in reversed(range(k)):
                g = sweep(advance(st, i, j), i + j, 1, 0, g)
            return g
        mid = advance(st, i, m)
        held.append(_nbytes(mid))
        most = max(most, sum(held))
        g = sweep(mid, i + m, k - m, s - 1, g)
        held.pop()
        del mid  # freed, as counted (the left part is reached from st again)
        return sweep(st, i, m, s, g)

    g = sweep(start, i0, n, slots, g)
    return g, most, steps


def audit_gradients(module: nn.Module, inputs: LowRankState | Tensor,
                    loss_fn: Callable[[LowRankState], Tensor]) -> float:
    """Cosine between the reversal gradient and dense autograd through the stored graph (same
    schedule), over all trainable parameters of ``module`` and the input. ``module`` is a
    :class:`LowRankODEBlock` or any module containing some (each replays its last schedule);
    ``loss_fn`` maps ``module(inputs)`` to a scalar. Logged at INFO."""
    blocks = [b for b in module.modules() if isinstance(b, LowRankODEBlock)]
    if not blocks:
        raise ValueError("audit_gradients: the module contains no LowRankODEBlock")
    params = [p for p in module.parameters() if p.requires_grad]

    def grads(reversible: bool) -> Tensor:
        x = inputs.detach().clone().requires_grad_(True) if isinstance(inputs, Tensor) else \
            LowRankState(*(t.detach().clone().requires_grad_(True) for t in (inputs.X, inputs.S, inputs.V)))
        leaves = [x] if isinstance(x, Tensor) else [x.X, x.S, x.V]
        for b in blocks:
            b.reversible = reversible
        loss = loss_fn(module(x))
        gs = torch.autograd.grad(loss, [*leaves, *params], allow_unused=True)
        return torch.cat([torch.zeros(0) if gr is None else gr.reshape(-1).double() for gr in gs])

    was = [b.reversible for b in blocks]
    try:
        g_rev = grads(True)
        for b in blocks:  # the reference follows the same schedules
            b._replay = b.last_tape
        g_ref = grads(False)
    finally:
        for b, w in zip(blocks, was, strict=True):
            b.reversible, b._replay = w, None
    cos = float(g_rev @ g_ref / (g_rev.norm() * g_ref.norm() + 1e-300))
    log.info("audit_gradients: cosine %.12f", cos)
    return cos
