"""The reversal backward of :class:`~rankwise.ode.LowRankODEBlock`: walk the recorded segments
in reverse, rebuild each state with :func:`ksl_reverse` (cotangents carried across the QR
frames), and replay a segment from its checkpoint where the reverse is unreliable — holding the
whole segment, or, under a memory budget, by the binomial schedule within the free slots.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import TYPE_CHECKING

import torch
from torch import Tensor

from ._frames import _align, _frame_invariant, _rel_factors
from ._revolve import recompute_cost, split
from ._state import LowRankState
from ._tape import Tape, _eps, _nbytes, tape_bytes

if TYPE_CHECKING:
    from ._block import LowRankODEBlock

log = logging.getLogger(__name__)

_SAFE = 1e4  # local defect (in units of eps) above which the backward always replays



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
    def forward(ctx, block: LowRankODEBlock, tape: Tape, X, S, V, *params):
        with torch.no_grad():
            out = block.run(LowRankState(X.detach(), S.detach(), V.detach()), record=tape)
        log.info("LowRankODEBlock forward: %s", tape.stats)
        ctx.block, ctx.tape, ctx.out = block, tape, out
        return out.X, out.S, out.V

    @staticmethod
    def backward(ctx, gX, gS, gV):
        block, tape = ctx.block, ctx.tape
        params = [p for p in block.field.parameters() if p.requires_grad]
        pgrads = [torch.zeros_like(p) for p in params]
        ctl = block.controller
        cur, g = ctx.out, (gX, gS, gV)  # a segment's end state and cotangent, in the forward's frame
        reloads, replay_bytes, recomputed, by_cost = 0, 0, 0, 0
        replayed = [False] * len(tape.starts)
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
                step = lambda st, i=i: block.step(st, i)  # noqa: E731
                with torch.no_grad():
                    prev = seg_start if j == 0 else block.reverse(c, i)
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
                        states.append(block.step(states[-1], i0 + k))
                recomputed += n - 1
                replay_bytes = max(replay_bytes, sum(_nbytes(st) for st in states))
                peak = max(peak, tape_bytes(tape) + sum(_nbytes(st) for st in states[1:]))
                for j in reversed(range(n)):
                    i = i0 + j
                    _, g, gp, _ = _vjp(lambda st, i=i: block.step(st, i), states[j], g, params)
                    add(pgrads, gp)
                del states
            replayed[seg] = not reversed_ok  # (the next forward's replay-aware caps read it)
            if event is not None:
                _, g, gp, _ = _vjp(lambda st, i0=i0, ev=event: block._enrich(st, i0, ev), cp, g, params)
                add(pgrads, gp)
            cur = cp
            if budget:  # the next segment's slots come from here (other controllers keep the tape,
                tape.checkpoints[seg] = None  # so that a retained graph can run its backward again)
        tape.replayed, tape.learned = replayed, False
        tape.stats.update(reloads=reloads, replay_bytes=replay_bytes, recomputed=recomputed,
                          peak_tape_bytes=peak, replayed_by_cost=by_cost)
        return (None, None, *g, *pgrads)


def _replay_binomial(start: LowRankState, i0: int, n: int, slots: int, g, block: LowRankODEBlock,
                     params, pgrads) -> tuple[tuple, int, int]:
    """Backpropagate through steps i0…i0+n−1 from the stored state `start`, holding at most
    `slots` more states (the binomial schedule of :mod:`._revolve`). Accumulates the parameter
    gradients into `pgrads`; returns (cotangent at `start`, the most bytes held besides
    `start`, steps recomputed)."""
    held: list[int] = []  # bytes of the states stored now
    most, steps = 0, 0

    def advance(st: LowRankState, i: int, k: int) -> LowRankState:
        nonlocal steps
        with torch.no_grad():
            for j in range(k):
                st = block.step(st, i + j)
        steps += k
        return st

    def sweep(st: LowRankState, i: int, k: int, s: int, g):
        nonlocal most
        if k == 1:
            _, g, gp, _ = _vjp(lambda x: block.step(x, i), st, g, params)
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
