"""The reversal backward of :class:`~rankwise.ode.LowRankODEBlock`: walk the recorded segments
from the last, taking each back by one of three strategies with one interface —

- :class:`Reverse`: rebuild each state with the exact reverse (cotangents carried across the
  QR frames);
- :class:`BinomialReplay`: replay from the segment's checkpoint within the free slots of a
  memory budget (revolve's schedule);
- :class:`FullReplay`: replay from the checkpoint holding the whole segment —

chosen per segment by :func:`choose` (the reverse first, a replay where it is cheaper under a
budget or where the loss sees the factors' frames, and a replay as the fallback where the
reverse turns out unreliable). The block is reached through the :class:`Integrator` protocol
(this module does not import the block's).
"""

from __future__ import annotations

import abc
import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import torch
from torch import Tensor, nn

from ._controller import AbstractController
from ._frames import _align, _frame_invariant, _rel_factors
from ._revolve import recompute_cost, split
from ._state import LowRankState
from ._tape import Tape, _eps, _nbytes, tape_bytes

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


class Integrator(Protocol):
    """What the backward needs of a block (:class:`~rankwise.ode.LowRankODEBlock` is one): its
    field and controller, one step i and its reverse, and an enrichment event replayed."""

    field: nn.Module
    controller: AbstractController

    def run(self, state: LowRankState, *, record: Tape | None = None) -> LowRankState: ...

    def step(self, state: LowRankState, i: int) -> LowRankState: ...

    def reverse(self, state: LowRankState, i: int) -> LowRankState: ...

    def apply_enrichment(self, state: LowRankState, i: int, event: tuple[int, int]) -> LowRankState: ...


@dataclass
class Segment:
    """One segment of the tape, as the backward takes it: steps start … start + length − 1 from
    `begin` (the checkpoint after its enrichment), with `slots` states a binomial replay may
    hold (None: a replay holds the whole segment)."""

    start: int
    length: int
    begin: LowRankState
    slots: int | None


@dataclass
class _Walk:
    """The backward's running state, read and updated by the strategies: the parameters and
    their gradients, the end state of the segment being taken back (`cur`), and the counters
    that go into the tape's statistics."""

    block: Integrator
    tape: Tape
    out: LowRankState  # the forward's output (the caller holds it: never counted)
    params: list[Tensor]
    pgrads: list[Tensor]
    cur: LowRankState | None = None
    reloads: int = 0
    replay_bytes: int = 0
    recomputed: int = 0
    by_cost: int = 0
    peak: int = 0

    def stored(self) -> int:
        """Bytes of the states the backward keeps for later: the tape's checkpoints, and the
        end state of the segment being reversed once it has left the tape (not the output).
        Working states (at most two while one step is reversed or recomputed) are not
        counted, as revolve does not count its current state."""
        kept = tape_bytes(self.tape)
        cur = self.cur
        if cur is not None and cur is not self.out and all(cur is not cp for cp in self.tape.checkpoints):
            kept += _nbytes(cur)
        return kept

    def add(self, grads) -> None:
        """Accumulate parameter gradients (None: unused) into the walk's."""
        for a, x in zip(self.pgrads, grads, strict=True):
            if x is not None:
                a.add_(x)


class Strategy(abc.ABC):
    """One way to take a segment back: from the cotangent at its end to the cotangent at its
    start (both in the frames the walk carries), accumulating the parameter gradients into the
    walk; None where it cannot (the caller then tries the next strategy)."""

    @abc.abstractmethod
    def __call__(self, walk: _Walk, seg: Segment, g: tuple) -> tuple | None: ...


class Reverse(Strategy):
    """Rebuild each state with the exact reverse, from the segment's end, and pull the cotangent
    through a recomputed step; the cotangent is carried across the QR frames. Gives up (None)
    where the local defect exceeds the controller's τ_grad or the safety net every controller
    gets, 1e4·eps (a fixed-point solve that failed, h·Lip(field) ≥ 1, must not yield silent
    wrong gradients). The parameter gradients are added only if the whole segment succeeds."""

    def __call__(self, walk: _Walk, seg: Segment, g: tuple) -> tuple | None:
        block, n = walk.block, seg.length
        if n > 1:
            walk.peak = max(walk.peak, walk.stored())
        grads = [torch.zeros_like(p) for p in walk.params]
        c, gc = walk.cur, g
        for j in reversed(range(n)):
            i = seg.start + j
            with torch.no_grad():
                prev = seg.begin if j == 0 else block.reverse(c, i)
            gin, gp, local = _vjp(lambda st, i=i: block.step(st, i), prev, gc, walk.params, ref=c)[1:]
            # (a one-step segment is computed from its checkpoint: nothing to check)
            if n > 1 and (block.controller.reload(local) or not local <= _SAFE * _eps(c)):  # NaN fails
                return None
            for a, x in zip(grads, gp, strict=True):
                if x is not None:
                    a.add_(x)
            c, gc = prev, gin
        walk.add(grads)
        return gc


class BinomialReplay(Strategy):
    """Replay the segment from its start holding at most `seg.slots` more states, by the
    binomial schedule (revolve's optimum for those slots)."""

    def __call__(self, walk: _Walk, seg: Segment, g: tuple) -> tuple:
        walk.cur = None  # a replay does not need the end state: its slot is free
        held = walk.stored()
        g, extra, steps = _replay_binomial(seg.begin, seg.start, seg.length, seg.slots, g, walk.block,
                                           walk.params, walk.pgrads)
        walk.recomputed += steps
        walk.replay_bytes = max(walk.replay_bytes, extra)
        walk.peak = max(walk.peak, held + extra)
        return g


class FullReplay(Strategy):
    """Replay the segment from its start holding all its states (in the forward's own frames:
    the cotangent at the segment's end is expressed in them)."""

    def __call__(self, walk: _Walk, seg: Segment, g: tuple) -> tuple:
        block = walk.block
        with torch.no_grad():  # the segment's states, held only while it is processed
            states = [seg.begin]
            for k in range(seg.length - 1):
                states.append(block.step(states[-1], seg.start + k))
        walk.recomputed += seg.length - 1
        walk.replay_bytes = max(walk.replay_bytes, sum(_nbytes(st) for st in states))
        walk.peak = max(walk.peak, tape_bytes(walk.tape) + sum(_nbytes(st) for st in states[1:]))
        for j in reversed(range(seg.length)):
            i = seg.start + j
            _, g, gp, _ = _vjp(lambda st, i=i: block.step(st, i), states[j], g, walk.params)
            walk.add(gp)
        return g


def choose(seg: Segment, *, frame_free: bool, reverse_cost: float) -> tuple[list[Strategy], bool]:
    """The policy: the strategies to try for `seg`, in order, and whether a replay was chosen
    because it costs fewer field evaluations than the reverse (a budget's choice). The reverse
    comes first unless the loss sees the factors' frames (then the cotangent cannot be carried
    across them) or, under a budget, a binomial replay is cheaper: ``recompute_cost(n, slots)``
    forward steps against n − 1 reversed steps of ``reverse_cost`` forward steps each (a
    segment's first step starts from its checkpoint). Its fallback is the replay."""
    replay: Strategy = BinomialReplay() if seg.slots is not None else FullReplay()
    if not frame_free:
        return [replay], False
    n = seg.length
    if seg.slots is not None and n > 1 and recompute_cost(n, seg.slots) < (n - 1) * reverse_cost:
        return [replay], True
    return [Reverse(), replay], False


class _Reversal(torch.autograd.Function):
    @staticmethod
    def forward(ctx, block: Integrator, tape: Tape, X, S, V, *params):
        with torch.no_grad():
            out = block.run(LowRankState(X.detach(), S.detach(), V.detach()), record=tape)
        log.info("LowRankODEBlock forward: %s", tape.stats)
        ctx.block, ctx.tape, ctx.out = block, tape, out
        return out.X, out.S, out.V

    @staticmethod
    def backward(ctx, gX, gS, gV):
        block, tape = ctx.block, ctx.tape
        params = [p for p in block.field.parameters() if p.requires_grad]
        walk = _Walk(block, tape, ctx.out, params, [torch.zeros_like(p) for p in params], cur=ctx.out)
        g = (gX, gS, gV)  # the cotangent at a segment's end, in the forward's frame
        replayed = [False] * len(tape.starts)
        budget = any(sl is not None for sl in tape.replay_slots)
        walk.peak = walk.stored()  # the checkpoints, plus what a replay holds on top
        # carrying g across QR frames is exact only if the loss does not see the frame (it
        # depends on F and the spans); otherwise every segment is replayed in the forward's frames
        frame_free = _frame_invariant(ctx.out, g)
        for k in reversed(range(len(tape.starts))):
            i0, cp, event = tape.starts[k], tape.checkpoints[k], tape.enrichments[k]
            if cp is None:
                raise RuntimeError("LowRankODEBlock under a MemoryBudget frees its checkpoints as its "
                                   "backward goes: backward through the same forward twice is not supported")
            with torch.no_grad():
                begin = block.apply_enrichment(cp, i0, event) if event is not None else cp
            seg = Segment(i0, tape.lengths[k], begin, tape.replay_slots[k])
            cost = tape.stats.get("reverse_cost", 0.0)
            plan, by_cost = choose(seg, frame_free=frame_free, reverse_cost=cost)
            walk.by_cost += by_cost
            for strategy in plan:
                result = strategy(walk, seg, g)
                if result is not None:
                    break
            g = result
            replayed[k] = not isinstance(strategy, Reverse)  # (the next forward's replay-aware caps read it)
            walk.reloads += replayed[k] and not by_cost  # the reverse failed, or the loss sees the frames
            if event is not None:
                enrich = lambda st, i0=i0, ev=event: block.apply_enrichment(st, i0, ev)  # noqa: E731
                _, g, gp, _ = _vjp(enrich, cp, g, params)
                walk.add(gp)
            walk.cur = cp
            if budget:  # the next segment's slots come from here (other controllers keep the tape,
                tape.checkpoints[k] = None  # so that a retained graph can run its backward again)
        tape.replayed, tape.learned = replayed, False
        tape.stats.update(reloads=walk.reloads, replay_bytes=walk.replay_bytes, recomputed=walk.recomputed,
                          peak_tape_bytes=walk.peak, replayed_by_cost=walk.by_cost)
        return (None, None, *g, *walk.pgrads)


def _replay_binomial(start: LowRankState, i0: int, n: int, slots: int, g, block: Integrator,
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
