"""The three choices the code makes on a measurement, each measured side by side in one run (CPU).

What is measured
    1. ``optim._batched.CPU_CHUNK``: on the CPU a group of layers is integrated in chunks of at
       most CPU_CHUNK elements per stacked augmented basis. Wall-clock ms of one DLRT step
       (forward, backward, update) of 4 layers 2048 → 2048 at rank 100 (batch 256, SGD with
       momentum 0.9), chunked as shipped (here: layer by layer) against one group of four.
    2. ``optim._step.svd_group(method="auto")`` takes LAPACK's SVD on the CPU: ms of the thin SVD
       of 4 float32 cores 200 × 200, ``"svd"`` against ``"gram"`` (float64 Gram matrix).
    3. ``nn._autograd._fn``: in plain eager a layer applies its Function in the ctx-in-forward
       style: µs of forward + backward of one LowRankLinear(64 → 64, rank 8) on a batch of 8,
       that form against the ``setup_context`` form torch.func needs.

    Each comparison alternates its two arms for ``--repeats`` blocks after a warm-up and prints
    the median block mean of each and their ratio.

How to run
    .venv/bin/python benchmarks/design_choices.py            # about 1 min on 2 cores
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import torch
from torch import nn

import rankwise
from rankwise.nn import _autograd
from rankwise.optim import _batched, _step


def _block(fn: Callable[[], object], n: int) -> float:
    t = time.perf_counter()
    for _ in range(n):
        fn()
    return (time.perf_counter() - t) / n


def _compare(arms: dict[str, tuple[Callable[[], None], Callable[[], None], Callable[[], object]]],
             n: int, repeats: int) -> dict[str, float]:
    """`arms`: name -> (enter, leave, call); the median over `repeats` of each arm's block mean (s)."""
    times: dict[str, list[float]] = {k: [] for k in arms}
    for rep in range(repeats + 1):
        for name, (enter, leave, call) in arms.items():
            enter()
            try:
                t = _block(call, n)
            finally:
                leave()
            if rep:  # the first round warms up
                times[name].append(t)
    return {k: statistics.median(v) for k, v in times.items()}


def _print(title: str, med: dict[str, float], unit: str, scale: float) -> None:
    (a, ta), (b, tb) = med.items()
    print(f"{title}\n  {a}: {ta * scale:.1f} {unit}   {b}: {tb * scale:.1f} {unit}   "
          f"{b} / {a} = {tb / ta:.2f}")


def chunking(repeats: int, steps: int) -> dict[str, float]:
    g = torch.Generator().manual_seed(0)
    X, Y = torch.randn(256, 2048, generator=g), torch.randn(256, 2048, generator=g)
    torch.manual_seed(0)
    dense = nn.Sequential(*[m for _ in range(4) for m in (nn.Linear(2048, 2048), nn.ReLU())][:-1])
    model = rankwise.to_low_rank(dense, rank=100)
    opt = rankwise.DLRT(model, 1e-3, tau=0.1, momentum=0.9, min_rank=100, max_rank=100)

    def closure():
        opt.zero_grad()
        loss = nn.functional.mse_loss(model(X), Y)
        loss.backward()
        return loss

    shipped = _batched.CPU_CHUNK

    def one_group():
        _batched.CPU_CHUNK = 2**62

    def restore():
        _batched.CPU_CHUNK = shipped

    step = lambda: opt.step(closure)  # noqa: E731
    return _compare({"chunked (shipped)": (restore, restore, step), "one group": (one_group, restore, step)},
                    steps, repeats)


def svd_choice(repeats: int, calls: int) -> dict[str, float]:
    S = torch.randn(4, 200, 200, generator=torch.Generator().manual_seed(0))
    nothing = lambda: None  # noqa: E731
    return _compare({"svd (shipped)": (nothing, nothing, lambda: _step.svd_group(S, "svd")),
                     "gram": (nothing, nothing, lambda: _step.svd_group(S, "gram"))}, calls, repeats)


def function_form(repeats: int, calls: int) -> dict[str, float]:
    torch.manual_seed(0)
    layer = rankwise.to_low_rank(nn.Sequential(nn.Linear(64, 64)), rank=8)[0]
    x = torch.randn(8, 64)
    plain = _autograd._LinearFn
    shipped = _autograd._VARIANTS[plain]

    def setup_context_form():
        _autograd._VARIANTS[plain] = (shipped[0], shipped[0])

    def restore():
        _autograd._VARIANTS[plain] = shipped

    def call():
        layer(x).sum().backward()

    return _compare({"ctx in forward (shipped)": (restore, restore, call),
                     "setup_context": (setup_context_form, restore, call)}, calls, repeats)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--repeats", type=int, default=7)
    args = p.parse_args()
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads; median of {args.repeats} blocks")
    _print("1. a group of 4 layers 2048² at rank 100, one DLRT step", chunking(args.repeats, 3), "ms", 1e3)
    _print("2. thin SVD of 4 float32 cores 200²", svd_choice(args.repeats, 20), "ms", 1e3)
    _print("3. forward + backward of LowRankLinear(64, 64, rank 8), batch 8",
           function_form(args.repeats, 300), "µs", 1e6)


if __name__ == "__main__":
    main()
