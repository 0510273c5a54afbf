"""LowRankODEBlock: a low-rank matrix ODE layer trained by reversal instead of a stored graph.

The forward pass keeps one factor checkpoint per segment of C steps (C set by the controller
from the reversal defect δ of each segment's last step), the two r×r rotations per step that the reverse needs
to return the forward's own factors, and the enrichment events. The backward pass walks the
steps in reverse: it reconstructs each state with :func:`ksl_reverse`, recomputes that one
step with autograd for its vector-Jacobian product, and replays forward from the segment's
checkpoint whenever the local defect exceeds the controller's τ_grad. Enrichment is replayed
with the same random seed; its new directions are treated as constants (like a pivot choice).
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
from ._ksl import _step, ksl_reverse, rank_ratio, relative_error
from ._state import LowRankState

log = logging.getLogger(__name__)


@dataclass
class Tape:
    """The forward schedule: per segment its first step, length, checkpoint (before
    enrichment) and enrichment ``(delta_r, seed)`` or None; per step the reverse's rotations."""

    starts: list[int] = dc_field(default_factory=list)
    lengths: list[int] = dc_field(default_factory=list)
    checkpoints: list[LowRankState] = dc_field(default_factory=list)
    enrichments: list[tuple[int, int] | None] = dc_field(default_factory=list)
    rotations: list[tuple[Tensor, Tensor]] = dc_field(default_factory=list)
    stats: dict = dc_field(default_factory=dict)


_SAFE = 1e4  # local defect (in units of eps) above which the backward always replays


def _eps(st: LowRankState) -> float:
    return torch.finfo(st.S.dtype).eps


def _rel(a: LowRankState, b: LowRankState) -> float:
    return float(relative_error(a, b).max())


def _rel_factors(a: LowRankState, b: LowRankState) -> float:
    """Largest relative difference of the factors X, S, V (not only of the product: with an
    ill-conditioned core the product can be right while the factors are rotated)."""
    tiny = torch.finfo(b.S.dtype).tiny
    return max(float((torch.linalg.matrix_norm(x - y) / (torch.linalg.matrix_norm(y) + tiny)).max())
               for x, y in ((a.X, b.X), (a.S, b.S), (a.V, b.V)))


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
    (and ``reloads`` after a backward pass).
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

    def _f(self, t: float, F: Tensor) -> Tensor:
        return self.field(t, F)

    def _enrich(self, state: LowRankState, i: int, event: tuple[int, int]) -> LowRankState:
        """Deterministic enrichment; new directions computed without gradient (constants)."""
        with torch.no_grad():
            g = torch.Generator(device=state.X.device).manual_seed(event[1])
            d = LowRankState(state.X.detach(), state.S.detach(), state.V.detach())
            new = enrich(d, self._f, i * self.h, event[0], alpha=self.alpha, generator=g)
        r = state.rank
        S = torch.zeros_like(new.S)
        S[:, :r, :r] = state.S
        S = S + torch.nn.functional.pad(new.S[:, r:, r:], (r, 0, r, 0))
        return LowRankState(torch.cat([state.X, new.X[..., r:]], -1), S,
                            torch.cat([state.V, new.V[..., r:]], -1))

    def run(self, state: LowRankState, *, record: Tape | None = None,
            replay: Tape | None = None) -> LowRankState:
        """Integrate all steps. ``record``: choose the schedule with the controller and record
        it (checkpoints, rotations, events, stats). ``replay``: follow a recorded schedule."""
        ctl, i, seg = self.controller, 0, 0
        c = ctl.initial_spacing()
        deltas, rhos = [], []
        while i < self.steps:
            if replay is not None:
                length, event = replay.lengths[seg], replay.enrichments[seg]
            else:
                length, event = min(c, self.steps - i), None
                if record is not None:
                    rho = float(rank_ratio(state).min())
                    room = min(state.X.shape[1], state.V.shape[1]) - state.rank
                    grow = min(ctl.rank_increase(state.rank, deltas[-1] if deltas else 0.0, rho), room)
                    event = (grow, self.seed * 100003 + seg) if grow > 0 else None
                    record.starts.append(i)
                    record.lengths.append(length)
                    record.checkpoints.append(state)
                    record.enrichments.append(event)
            if event is not None:
                state = self._enrich(state, i, event)
            for j in range(length):
                prev = state
                state, Qx, Qv = _step(state, self._f, (i + j) * self.h, self.h)
                if record is not None:
                    record.rotations.append((Qx, Qv))
            if record is not None:  # δ of the segment's last step drives the controller
                t_last = (i + length - 1) * self.h
                back = ksl_reverse(state, self._f, t_last, self.h, rotations=record.rotations[-1])
                deltas.append(_rel(back, prev))
                rhos.append(float(rank_ratio(state).min()))
                c = ctl.next_spacing(c, deltas[-1])
            i += length
            seg += 1
        if record is not None:
            record.stats = dict(rank=state.rank, checkpoints=len(record.checkpoints),
                                max_delta=max(deltas), mean_delta=sum(deltas) / len(deltas),
                                min_rho=min(rhos))
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


def _vjp(fn: Callable[[LowRankState], LowRankState], state: LowRankState, g, params):
    """Recompute ``fn(state)`` with autograd: (output, cotangents of X, S, V, param grads)."""
    X, S, V = (t.detach().requires_grad_(True) for t in (state.X, state.S, state.V))
    with torch.enable_grad():
        out = fn(LowRankState(X, S, V))
        pairs = [(o, go) for o, go in zip((out.X, out.S, out.V), g, strict=True) if go is not None]
        grads = torch.autograd.grad([o for o, _ in pairs], [X, S, V, *params],
                                    [go for _, go in pairs], allow_unused=True)
    gin = tuple(torch.zeros_like(t) if gr is None else gr for t, gr in zip((X, S, V), grads[:3], strict=True))
    done = LowRankState(out.X.detach(), out.S.detach(), out.V.detach())
    return done, gin, grads[3:]


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
        cur, g = ctx.out, (gX, gS, gV)
        h, f, reloads = block.h, block._f, 0

        def add(gp):
            for acc, x in zip(pgrads, gp, strict=True):
                if x is not None:
                    acc.add_(x)

        for seg in reversed(range(len(tape.starts))):
            i0, n = tape.starts[seg], tape.lengths[seg]
            cp, event = tape.checkpoints[seg], tape.enrichments[seg]
            with torch.no_grad():
                seg_start = block._enrich(cp, i0, event) if event is not None else cp
            for j in reversed(range(n)):
                i = i0 + j
                step = lambda st, i=i: _step(st, f, i * h, h)[0]  # noqa: E731
                with torch.no_grad():
                    prev = seg_start if j == 0 else ksl_reverse(cur, f, i * h, h, rotations=tape.rotations[i])
                out, gin, gp = _vjp(step, prev, g, params)
                local = _rel_factors(out, cur)  # the cotangent g is w.r.t. cur's own factors
                # the controller's τ_grad, plus a safety net every controller gets: a reverse whose
                # fixed-point solve failed (h·Lip(field) ≥ 1) must not yield silent wrong gradients
                if j > 0 and (block.controller.reload(local) or local > _SAFE * _eps(cur)):
                    reloads += 1  # reversal drifted: replay from the checkpoint instead
                    with torch.no_grad():
                        prev = seg_start
                        for k in range(j):
                            prev = _step(prev, f, (i0 + k) * h, h)[0]
                    out, gin, gp = _vjp(step, prev, g, params)
                add(gp)
                cur, g = prev, gin
            if event is not None:
                cur, g, gp = _vjp(lambda st, i0=i0, ev=event: block._enrich(st, i0, ev), cp, g, params)
                cur = cp
                add(gp)
        block.last_stats = {**tape.stats, "reloads": reloads}
        return (None, *g, *pgrads)


def audit_gradients(module: LowRankODEBlock, inputs: LowRankState | Tensor,
                    loss_fn: Callable[[LowRankState], Tensor]) -> float:
    """Cosine between the reversal gradient and dense autograd through the stored graph (same
    schedule), over the field's parameters and the input. Logged at INFO."""
    params = [p for p in module.field.parameters() if p.requires_grad]

    def grads(reversible: bool) -> Tensor:
        x = inputs.detach().clone().requires_grad_(True) if isinstance(inputs, Tensor) else \
            LowRankState(*(t.detach().clone().requires_grad_(True) for t in (inputs.X, inputs.S, inputs.V)))
        leaves = [x] if isinstance(x, Tensor) else [x.X, x.S, x.V]
        module.reversible = reversible
        loss = loss_fn(module(x))
        gs = torch.autograd.grad(loss, [*leaves, *params], allow_unused=True)
        return torch.cat([torch.zeros(0) if gr is None else gr.reshape(-1).double() for gr in gs])

    was = module.reversible
    try:
        g_rev = grads(True)
        module._replay = module.last_tape  # the reference follows the same schedule
        g_ref = grads(False)
    finally:
        module.reversible, module._replay = was, None
    cos = float(g_rev @ g_ref / (g_rev.norm() * g_ref.norm() + 1e-300))
    log.info("audit_gradients: cosine %.12f", cos)
    return cos
