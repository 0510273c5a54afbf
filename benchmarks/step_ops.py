"""Host reads and dispatched ops of one DLRT / SDLRT step of a GPT, by depth (counted, not timed).

What is counted
    ``rankwise.models.gpt(width=128, context=16)`` at depth 2 and 8 (12 and 48 low-rank
    projections, rank 16 at the start), Adam rule, ``tau`` (default 1e-3); after `--after`
    steps (default 1), one more step is counted with ``rankwise._opcount.OpCounter``: the
    optimizer's own dispatched aten ops (the closure's forward and backward paused), those of
    them that are not views ("kernel ops": a slice or transpose launches nothing on a GPU) and
    its host reads (``.item()``, ``nonzero``, ``tolist``...; on CUDA each is a device→host
    synchronisation), then the host reads of a whole ``opt.step(closure)`` (forward and
    backward included). Rows: fixed ranks (``adaptive=False``) and adaptive ranks, DLRT and
    SDLRT; the last columns are the ops at depth 8 over those at depth 2, and over those of the
    same optimizer at fixed ranks (depth 8).

    ``--implementation exact`` counts groups of one rank (no rank buckets) instead; ``--grid
    fine`` buckets ranks on the finer grid 2^j, 1.25·2^j, 1.5·2^j instead of powers of two (the
    ablation behind rankwise's choice; benchmark-only, by replacing ``_step.rank_bucket``).
    ``--process-group replicated`` or ``sharded`` builds the optimizer data parallel over a
    one-process gloo group (the collectives' own host reads included).

How to run
    .venv/bin/python benchmarks/step_ops.py               # about 30 s on 2 cores
    .venv/bin/python benchmarks/step_ops.py --tau 0.05 --lr 3e-3 --after 8 [--implementation exact]
    .venv/bin/python benchmarks/step_ops.py --process-group sharded
    .venv/bin/python benchmarks/step_ops.py --two-pass
    .venv/bin/python benchmarks/step_ops.py --tau 0.05 --lr 3e-3 --after 8 --capacity auto
    .venv/bin/python benchmarks/step_ops.py --tau 0.05 --lr 3e-3 --after 8 --by-op   # where the ops go
"""

from __future__ import annotations

import argparse
import tempfile

import torch
from torch import nn

import rankwise
from rankwise._opcount import step_counts
from rankwise.models import gpt


def counts(depth: int, cls, after: int = 1, tau: float = 1e-3, lr: float = 1e-3, by_op: bool = False,
           capacity=None, **kw) -> tuple:
    """(low-rank layers, optimizer ops, optimizer host reads, host reads of the whole step,
    kernel ops, distinct ranks), counted after `after` steps; with `by_op` the counted step's
    kernel ops by name instead (a Counter)."""
    torch.manual_seed(0)
    m = gpt(width=128, depth=depth, context=16)
    rankwise.to_low_rank(m, rank=16, capacity=capacity)
    opt = cls(m, lr, tau=tau, optimizer="adam", **kw)
    x = torch.randint(0, 256, (2, 17))

    def closure():
        opt.zero_grad()
        out = m(x[:, :-1])
        loss = nn.functional.cross_entropy(out.reshape(-1, out.shape[-1]), x[:, 1:].reshape(-1))
        loss.backward()
        return loss

    for _ in range(after):
        opt.step(closure)
    ranks = len(set(opt.ranks().values()))  # before the counted step
    if by_op:
        from rankwise._opcount import OpCounter

        closure()
        with OpCounter() as c:
            opt.step()
        return c.kernels_by_op
    return (len(opt.layers), *step_counts(opt, closure, kernels=True), ranks)


def _fine_bucket(r: int) -> int:
    """The smallest of 2^j, 1.25·2^j, 1.5·2^j (rounded up) at least r."""
    if r <= 4:
        return r
    j = r.bit_length() - 1
    return next(g for g in (2**j, -(-5 * 2**j // 4), -(-3 * 2**j // 2), 2**(j + 1)) if g >= r)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--implementation", choices=("batched", "exact"), default="batched")
    p.add_argument("--after", type=int, default=1, help="steps taken before the counted one")
    p.add_argument("--tau", type=float, default=1e-3, help="truncation tolerance")
    p.add_argument("--lr", type=float, default=1e-3, help="learning rate")
    p.add_argument("--grid", choices=("pow2", "fine"), default="pow2", help="rank buckets (see above)")
    p.add_argument("--by-op", action="store_true",
                   help="DLRT at depth 8: the kernel ops (views aside) by name, adaptive minus fixed ranks")
    p.add_argument("--process-group", choices=("none", "replicated", "sharded"), default="none",
                   help="data parallel over a one-process gloo group")
    p.add_argument("--two-pass", action="store_true", help="two-pass BUG (single_pass=False)")
    p.add_argument("--capacity", default=None,
                   help="fixed-capacity factors (an int, or 'auto': twice the rank; default exact shapes)")
    a = p.parse_args(argv)
    extra = {"single_pass": False} if a.two_pass else {}
    if a.process_group != "none":
        import torch.distributed as dist

        dist.init_process_group("gloo", init_method=f"file://{tempfile.mkdtemp()}/pg", rank=0, world_size=1)
        extra.update(process_group=dist.group.WORLD, data_parallel=a.process_group)
    extra["implementation"] = a.implementation
    if a.capacity is not None:
        extra["capacity"] = a.capacity if a.capacity == "auto" else int(a.capacity)
    if a.grid == "fine":
        from rankwise.optim import _step

        _step.rank_bucket = _fine_bucket
    if a.by_op:
        fixed = counts(8, rankwise.DLRT, a.after, a.tau, a.lr, by_op=True, adaptive=False, **extra)
        spread = counts(8, rankwise.DLRT, a.after, a.tau, a.lr, by_op=True, adaptive=True, **extra)
        print(f"DLRT depth 8, kernel ops: fixed {fixed.total()}, adaptive {spread.total()}; "
              "the largest differences:")
        print("| op | fixed | adaptive | adaptive − fixed |")
        print("|---|---|---|---|")
        for k in sorted(set(fixed) | set(spread), key=lambda k: fixed[k] - spread[k])[:12]:
            print(f"| {k} | {fixed[k]} | {spread[k]} | {spread[k] - fixed[k]} |")
        return
    print(f"torch {torch.__version__}, implementation {a.implementation}, grid {a.grid}, "
          f"process group: {a.process_group}, "
          f"{'two-pass, ' if a.two_pass else ''}tau {a.tau}, lr {a.lr}, counted at step {a.after + 1}")
    print("| optimizer | ranks | depth | layers | distinct ranks | optimizer ops | kernel ops "
          "| optimizer host reads | step host reads | ops depth 8 / depth 2 | ops / fixed ranks |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for cls in (rankwise.DLRT, rankwise.SDLRT):
        fixed = None
        for adaptive in (False, True):
            rows = [(d, counts(d, cls, a.after, a.tau, a.lr, adaptive=adaptive, **extra)) for d in (2, 8)]
            fixed = rows[1][1] if not adaptive else fixed
            for d, (n, ops, reads, whole, kernels, distinct) in rows:
                depth = f"{ops / rows[0][1][1]:.2f} ({kernels / rows[0][1][4]:.2f})" if d == 8 else ""
                vs = f"{ops / fixed[1]:.2f} ({kernels / fixed[4]:.2f})" if d == 8 else ""
                kind = "adaptive" if adaptive else "fixed"
                print(f"| {cls.__name__} | {kind} | {d} | {n} | {distinct} | {ops} | {kernels} | {reads} "
                      f"| {whole} | {depth} | {vs} |")
    print("(ratios: all ops, in parentheses kernel ops)")


if __name__ == "__main__":
    main()
