"""What a reversed step costs on the permuted-digits model, by solver, against autograd.

Run: ``.venv/bin/python benchmarks/ode_reverse.py`` (about four minutes on one core). The
model of docs/ode.md (`SequenceClassifier`: 64 steps, 32×32 memory of rank 8, p = 16, per-step
input maps, float32, causal step), batch 64 of permuted digits, after 30 Adam steps (so that
the field is not at its initial values). For each way of taking the gradient:

- field evaluations per reversed step (the three implicit substeps of ``ksl_reverse``);
- the largest relative reversal defect of a reversed step against the forward's state;
- the memory held for the backward (the block's measured peak tape; autograd: the bytes its
  graph saves, as `rankwise ode` counts them) and its ratio to autograd's;
- the median time of a forward plus backward (interleaved repeats), and its ratio to autograd;
- last, what one reversed step costs in forward steps of time (64 steps each way, no autograd).

Rows: ``autograd`` (the stored graph), reversal with a fixed controller (C = 8) by the Picard
and the Anderson solver, ``MemoryBudget(max_states=4)`` by each solver, and budgets of 16 and
28 states (Anderson; a budget replays by the binomial schedule where that is cheaper than the
reverse). "Reversed steps" includes the forward pass's one reverse per segment (its δ).
"""

from __future__ import annotations

import os
import statistics
import time

import torch
from torch import nn

from rankwise.experiments.ode_seq import _SavedBytes, load_sequences
from rankwise.ode import FixedController, LowRankState, MemoryBudget, SequenceClassifier
from rankwise.ode._ksl import relative_error

REPEATS = int(os.environ.get("REPEATS", 7))  # interleaved repeats per row


def trained_digits_model() -> tuple[SequenceClassifier, torch.Tensor, torch.Tensor]:
    """(model, u, y): the digits model after 30 Adam steps on one batch of 64 (also used by
    ode_budget.py)."""
    u, y, _, _ = load_sequences("digits", 0)
    u, y = u[:64], y[:64]
    torch.manual_seed(0)
    model = SequenceClassifier(64, 10, controller=FixedController(8, 8), position_weights=True)
    opt = torch.optim.Adam(model.parameters(), lr=3e-3)
    for _ in range(30):
        opt.zero_grad()
        nn.functional.cross_entropy(model(u), y).backward()
        opt.step()
    return model, u, y


def main() -> None:
    torch.set_num_threads(1)
    model, u, y = trained_digits_model()
    block = model.block
    rows = {"autograd": (False, FixedController(8, 8), "anderson"),
            "reversal C=8, picard": (True, FixedController(8, 8), "picard"),
            "reversal C=8, anderson": (True, FixedController(8, 8), "anderson"),
            "budget 4 states, picard": (True, MemoryBudget(max_states=4), "picard"),
            "budget 4 states, anderson": (True, MemoryBudget(max_states=4), "anderson"),
            "budget 16 states, anderson": (True, MemoryBudget(max_states=16), "anderson"),
            "budget 28 states, anderson": (True, MemoryBudget(max_states=28), "anderson")}

    counts = {"evals": 0, "reverses": 0, "defect": 0.0}
    field = model.field
    inner = {k: getattr(field, k) for k in ("forward", "bind_right", "bind_left", "bind_project")
             if hasattr(field, k)}  # (a source tree before the bound projections counts none)

    def counted(fn):
        def call(*a, **kw):
            counts["evals"] += 1
            return fn(*a, **kw)
        return call

    def counting(name):  # the dense field per call; a bound projection per call of what it returns
        if name == "forward":
            return counted(inner[name])
        return lambda *a, **kw: counted(inner[name](*a, **kw))

    real_reverse = block.reverse

    def reverse(state, i, fld=None):
        before = counts["evals"]
        for k in inner:
            setattr(field, k, counting(k))
        try:
            out = real_reverse(state, i, fld)
        finally:
            for k in inner:
                setattr(field, k, inner[k])
        counts["reverses"] += 1
        counts["evals_rev"] = counts.get("evals_rev", 0) + counts["evals"] - before
        with torch.no_grad():  # the defect against a forward step from the rebuilt state
            again = block.step(out, i)
            counts["defect"] = max(counts["defect"], float(relative_error(again, state).max()))
        return out

    saved = _SavedBytes(model)

    def once(name, measure: bool = False) -> float:
        reversible, ctl, solver = rows[name]
        block.reversible, block.controller, block.solver = reversible, ctl, solver
        model.zero_grad()
        t0 = time.perf_counter()
        nn.functional.cross_entropy((saved if measure else model)(u), y).backward()
        return time.perf_counter() - t0

    results = {}
    for name in rows:  # evaluations and defects, in a pass of their own (counting costs time)
        counts.update(evals=0, reverses=0, defect=0.0, evals_rev=0)
        block.reverse = reverse
        once(name, measure=True)
        block.reverse = real_reverse
        held = block.last_stats["peak_tape_bytes"] if rows[name][0] else saved.last
        results[name] = dict(counts, memory=held)
    times = {name: [] for name in rows}
    for _ in range(REPEATS):
        for name in rows:
            times[name].append(once(name))
    base = statistics.median(times["autograd"])
    print(f"permuted digits, SequenceClassifier (64 steps, m 32, rank 8, p 16), batch 64, float32; "
          f"median of {REPEATS}")
    print("| gradient | reversed steps | field evals per reversed step | max defect of a reversed step "
          "| memory held for the backward, MiB | vs autograd | forward + backward, s | vs autograd |")
    print("|---|---|---|---|---|---|---|---|")
    ref = results["autograd"]["memory"]
    for name in rows:
        r, t = results[name], statistics.median(times[name])
        per = f"{r['evals_rev'] / r['reverses']:.1f}" if r["reverses"] else "—"
        defect = f"{r['defect']:.1e}" if r["reverses"] else "—"
        print(f"| {name} | {r['reverses']} | {per} | {defect} | {r['memory'] / 2**20:.2f} | "
              f"{r['memory'] / ref:.4f} | {t:.3f} | {t / base:.2f} |")
    fwd, rev = step_times(block, u)
    print(f"\n64 steps without autograd, median of {REPEATS}: forward {fwd:.3f} s, reverse (picard) "
          f"{rev:.3f} s: a reversed step costs {rev / fwd:.2f} forward steps in time")


def step_times(block, u) -> tuple[float, float]:
    """Median times of the 64 forward steps and of their 64 reverses, without autograd."""
    block.solver = "picard"
    fwd, rev = [], []
    with torch.no_grad():
        block.field.set_input(u)
        F0 = 0.01 * torch.randn(u.shape[0], 32, 32, generator=torch.Generator().manual_seed(1))
        states = [LowRankState.from_dense(F0, 8)]
        for i in range(64):
            states.append(block.step(states[-1], i))
        for _ in range(REPEATS):
            t0 = time.perf_counter()
            st = states[0]
            for i in range(64):
                st = block.step(st, i)
            fwd.append(time.perf_counter() - t0)
            t0 = time.perf_counter()
            for i in reversed(range(64)):
                block.reverse(states[i + 1], i)
            rev.append(time.perf_counter() - t0)
    return statistics.median(fwd), statistics.median(rev)


if __name__ == "__main__":
    main()
