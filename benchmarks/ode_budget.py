"""Reversal backprop under a memory budget (`rankwise.ode.MemoryBudget`) against revolve's
optimum for the same budget, in one run.

Run: ``.venv/bin/python benchmarks/ode_budget.py`` (about five minutes, one thread). One
LowRankODEBlock (the tanh field of the tests, m = n = 32, rank 8, batch 16, 64 steps, float64);
budgets of S + 1 states. For each budget:

- ``budget``: MemoryBudget as shipped — each segment either reversed (states rebuilt by the
  exact reverse) or replayed by the binomial schedule, whichever costs fewer field evaluations
  (a reversed step costs ``reverse_cost`` forward steps, counted in the forward pass), and
  replayed anyway where the local defect says the reverse is unreliable;
- ``revolve``: the same checkpoints with every segment replayed by the binomial schedule
  (``tau_grad`` ≈ 0): revolve's optimum for this budget, recomputing D(64, S) steps;
- ``autograd``: the stored graph, for reference (its memory is every intermediate).

Peak tape bytes are measured from the tensors the block holds; times are medians of 3 of a
forward plus backward.

A second table does the same on the product's own model (`SequenceClassifier` on permuted
digits: 64 steps, m 32, rank 8, p 16, float32, batch 64, after 30 Adam steps), whose field
binds its projections (a reversed step costs fewer forward steps of time than of evaluations),
for budgets of 1 to 3 states.
"""

from __future__ import annotations

import statistics
import time

import torch
from torch import nn

from rankwise.ode import LowRankODEBlock, MemoryBudget
from rankwise.ode._revolve import planned_cost

B, M, R, STEPS, H = 16, 32, 8, 64, 0.05


class Field(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(0)
        self.A = nn.Parameter(0.3 * torch.randn(M, M, generator=g, dtype=torch.float64))
        self.B = nn.Parameter(0.3 * torch.randn(M, M, generator=g, dtype=torch.float64))
        self.C = nn.Parameter(0.3 * torch.randn(M, M, generator=g, dtype=torch.float64))

    def forward(self, t, F):
        return torch.tanh(self.A @ F @ self.B.T) - 0.1 * F + self.C


def run(block: LowRankODEBlock, F0: torch.Tensor, repeats: int = 3) -> tuple[float, dict]:
    times = []
    for _ in range(repeats):
        block.field.zero_grad()
        t0 = time.perf_counter()
        (block(F0).dense() ** 2).sum().backward()
        times.append(time.perf_counter() - t0)
    return statistics.median(times), dict(block.last_stats)


def main() -> None:
    torch.set_num_threads(1)
    F0 = torch.randn(B, M, M, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    state = (M * R + R * R + M * R) * B * 8
    field = Field()
    auto = LowRankODEBlock(field, rank=R, steps=STEPS, h=H, controller=MemoryBudget(STEPS * state),
                           reversible=False)
    t_auto, _ = run(auto, F0)
    print(f"{STEPS} steps, state {state} bytes (m = n = {M}, rank {R}, batch {B}, float64); "
          f"autograd through the stored graph: {t_auto:.3f} s\n")
    print("| budget (states) | method | checkpoints | peak tape (states) | segments not replayed / replayed "
          "| recomputed steps (revolve's optimum D) | forward + backward (s) | time / revolve |")
    print("|---|---|---|---|---|---|---|---|")
    for slots in (1, 2, 3, 5, 9, 17):
        rows = {}
        for name, tau in (("budget", None), ("revolve", 1e-300)):
            block = LowRankODEBlock(field, rank=R, steps=STEPS, h=H,
                                    controller=MemoryBudget(slots * state, tau_grad=tau))
            rows[name] = run(block, F0)
        for name, (t, st) in rows.items():
            replayed = st["replayed_by_cost"] + st["reloads"]
            print(f"| {slots} | {name} | {st['checkpoints']} | {st['peak_tape_bytes'] / state:.2f} | "
                  f"{st['checkpoints'] - replayed} / {replayed} | "
                  f"{st['recomputed']} ({planned_cost(STEPS, slots - 1)}) | {t:.3f} | "
                  f"{t / rows['revolve'][0]:.2f} |")
    print(f"\nA reversed step costs {st['reverse_cost']:.1f} forward steps of field evaluations here.")
    gated()


def gated() -> None:
    """The budget against revolve on the permuted-digits model (see the module docstring)."""
    from ode_reverse import trained_digits_model  # (benchmarks/, the script's folder, is on the path)
    from rankwise.ode import FixedController

    model, u, y = trained_digits_model()

    def once() -> float:
        model.zero_grad()
        t0 = time.perf_counter()
        nn.functional.cross_entropy(model(u), y).backward()
        return time.perf_counter() - t0

    model.block.reversible = False
    t_auto = statistics.median(once() for _ in range(3))
    model.block.reversible = True
    print(f"\nThe digits model (64 steps, m 32, rank 8, p 16, batch 64, float32); autograd: {t_auto:.3f} s\n")
    print("| budget (states) | method | peak tape (states) | segments not replayed / replayed "
          "| recomputed steps | forward + backward (s) | time / revolve |")
    print("|---|---|---|---|---|---|---|")
    state = 4 * 64 * (2 * 32 * 8 + 8 * 8)
    for slots in (1, 2, 3):
        rows = {}
        for name, tau in (("budget", None), ("revolve", 1e-300)):
            model.block.controller = MemoryBudget(max_states=slots, tau_grad=tau)
            rows[name] = statistics.median(once() for _ in range(3)), dict(model.block.last_stats)
        for name, (t, st) in rows.items():
            replayed = st["replayed_by_cost"] + st["reloads"]
            print(f"| {slots} | {name} | {st['peak_tape_bytes'] / state:.2f} | "
                  f"{st['checkpoints'] - replayed} / {replayed} | {st['recomputed']} | {t:.3f} | "
                  f"{t / rows['revolve'][0]:.2f} |")
    print(f"\nA reversed step costs {st['reverse_cost']:.1f} forward steps of field evaluations here.")
    for c in (16, 8):  # the reverse over C-step segments against revolve at the peak it reached
        model.block.controller = FixedController(c, 8)
        t_rev = statistics.median(once() for _ in range(3))
        st = dict(model.block.last_stats)
        held = st["peak_tape_bytes"] / state
        model.block.controller = MemoryBudget(max_states=round(held), tau_grad=1e-300)
        t_rvl = statistics.median(once() for _ in range(3))
        st2 = dict(model.block.last_stats)
        print(f"reverse, C = {c}: peak {held:.2f} states, {st['reloads']} segments replayed, {t_rev:.3f} s; "
              f"revolve at {round(held)} states: peak {st2['peak_tape_bytes'] / state:.2f}, "
              f"{st2['recomputed']} steps recomputed, {t_rvl:.3f} s; reverse / revolve {t_rev / t_rvl:.2f}")


if __name__ == "__main__":
    main()
