"""What a compression target costs per training step: DLRT with a global budget against DLRT
with a tolerance, at the same ranks, side by side in one run.

Model: ``--depth`` layers of ``--width``×``--width`` (ReLU between), batch 256, MSE, SGD
momentum 0.9, every layer starting at the rank that gives ``--compression``. Three
configurations, each on its own copy of one initialisation:

- ``tau``: ``DLRT(tau=...)`` with the ranks pinned (min_rank = max_rank = r): the truncation as
  usual, nothing global;
- ``target``: ``DLRT(target=c, ramp_steps=0)``: every augmentation also computes the budget and
  allocates the ranks model-wide (one SVD per layer is shared with the truncation);
- ``dense``: ``torch.optim.SGD`` on the dense model, for scale.

The blocks are interleaved (dense, tau, target, dense, …) and each figure is the median of
``--repeats`` blocks of ``--steps`` steps. Usage: ``python benchmarks/budget_overhead.py``.
"""

from __future__ import annotations

import argparse
import copy
import platform
import statistics
import time

import torch
from torch import nn

import rankwise
from step_time import dense_mlp as mlp  # benchmarks/ is on sys.path when run as a script
from step_time import rank_for


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--width", type=int, default=1024)
    p.add_argument("--depth", type=int, default=4)
    p.add_argument("--compression", type=float, default=0.9)
    p.add_argument("--steps", type=int, default=5, help="steps per timed block")
    p.add_argument("--repeats", type=int, default=9, help="timed blocks per configuration")
    p.add_argument("--threads", type=int, default=1)
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    w = args.width
    x, y = torch.randn(256, w), torch.randn(256, w)
    dense = mlp(w, args.depth)
    r = rank_for(w, w, args.compression)
    base = rankwise.to_low_rank(copy.deepcopy(dense), rank=r)
    configs: dict[str, tuple[nn.Module, torch.optim.Optimizer]] = {
        "dense": (dense, torch.optim.SGD(dense.parameters(), lr=1e-3, momentum=0.9))}
    m_tau = copy.deepcopy(base)
    configs["tau"] = (m_tau, rankwise.DLRT(m_tau, 1e-3, tau=0.1, momentum=0.9, min_rank=r, max_rank=r))
    m_target = copy.deepcopy(base)
    target = rankwise.compression(m_target)["ratio"]  # exactly the pinned ranks' compression
    configs["target"] = (m_target, rankwise.DLRT(m_target, 1e-3, target=target, ramp_steps=0,
                                                 momentum=0.9))

    def block(name: str) -> float:
        model, opt = configs[name]

        def closure():
            opt.zero_grad()
            loss = nn.functional.mse_loss(model(x), y)
            loss.backward()
            return loss

        t0 = time.perf_counter()
        for _ in range(args.steps):
            opt.step(closure)
        return (time.perf_counter() - t0) / args.steps

    for name in configs:  # warm-up
        block(name)
    times: dict[str, list[float]] = {name: [] for name in configs}
    for _ in range(args.repeats):
        for name in configs:
            times[name].append(block(name))
    ms = {name: 1e3 * statistics.median(t) for name, t in times.items()}
    ranks_target = sorted(set(configs["target"][1].ranks().values()))
    print(f"torch {torch.__version__}, {platform.machine()}, {args.threads} thread(s); {args.depth} layers "
          f"{w}×{w}, batch 256; rank {r} (compression {target:.3f}); target run's ranks {ranks_target}; "
          f"median of {args.repeats} interleaved blocks of {args.steps} steps")
    print()
    print("| configuration | ms/step | × tau |")
    print("|---|---|---|")
    for name in configs:
        print(f"| {name} | {ms[name]:.1f} | {ms[name] / ms['tau']:.3f} |")


if __name__ == "__main__":
    main()
