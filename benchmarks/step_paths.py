"""The optimizer's two implementations, interleaved in one process (CPU or GPU).

What is measured
    Wall-clock ms of one ``opt.step(closure)`` (forward, backward, update) for dense (SGD with
    momentum 0.9 on the MLP, AdamW on the GPT), DLRT and SDLRT with ``implementation="batched"``
    (rank buckets, the default) and ``"exact"`` (groups of one rank, room for every new
    direction), in one process, so both see the same machine state. After a warm-up, every
    repeat times one block of ``--steps`` steps per configuration in a fixed order; the table
    shows the median block mean and the ratio to dense, and the closure alone (forward and
    backward, timed in its own block right after) and the rest of the step (the update).

    Models: ``mlp``: 4 layers 2048 → 2048, batch 256, rank 100 pinned (``min_rank = max_rank``,
    90 % compression; momentum 0.9, ``tau=0.1``) — the ``make bench`` configuration; ``gpt``:
    ``gpt(width=128, depth=4, context=64)``, batch 8, its 24 projections at rank 32
    (``max_rank=32``, Adam rule, ``tau=1e-3``).

How to run
    .venv/bin/python benchmarks/step_paths.py              # both models, about 2 min on 2 cores
    .venv/bin/python benchmarks/step_paths.py --model gpt --repeats 9
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from torch import nn

import rankwise
from rankwise.models import gpt


def _mlp_problem():
    g = torch.Generator().manual_seed(0)
    X, Y = torch.randn(256, 2048, generator=g), torch.randn(256, 2048, generator=g)

    def make(kind: str, implementation: str = "batched"):
        torch.manual_seed(0)
        layers: list[nn.Module] = []
        for i in range(4):
            layers += [nn.Linear(2048, 2048)] + ([nn.ReLU()] if i < 3 else [])
        m = nn.Sequential(*layers)
        if kind == "dense":
            return m, torch.optim.SGD(m.parameters(), 1e-3, momentum=0.9)
        rankwise.to_low_rank(m, rank=100)
        cls = rankwise.DLRT if kind == "DLRT" else rankwise.SDLRT
        return m, cls(m, 1e-3, tau=0.1, momentum=0.9, min_rank=100, max_rank=100,
                      implementation=implementation)

    return make, lambda m: ((m(X) - Y) ** 2).mean()


def _gpt_problem():
    x = torch.randint(0, 256, (8, 65), generator=torch.Generator().manual_seed(0))

    def make(kind: str, implementation: str = "batched"):
        torch.manual_seed(0)
        m = gpt(width=128, depth=4, context=64)
        if kind == "dense":
            return m, torch.optim.AdamW(m.parameters(), 1e-3)
        names = [n for n, mm in m.named_modules()
                 if isinstance(mm, nn.Linear) and (".attn." in n or n.endswith((".fc", ".proj")))]
        rankwise.to_low_rank(m, rank=32, max_rank=32, include=names)
        cls = rankwise.DLRT if kind == "DLRT" else rankwise.SDLRT
        return m, cls(m, 1e-3, tau=1e-3, optimizer="adam", implementation=implementation)

    def loss(m):
        out = m(x[:, :-1])
        return nn.functional.cross_entropy(out.reshape(-1, out.shape[-1]), x[:, 1:].reshape(-1))

    return make, loss


def measure(problem, repeats: int, steps: int) -> dict[str, float]:
    make, loss_fn = problem
    configs = [("dense", "dense", "batched"), ("DLRT", "DLRT", "batched"), ("DLRT exact", "DLRT", "exact"),
               ("SDLRT", "SDLRT", "batched"), ("SDLRT exact", "SDLRT", "exact")]
    runs = {}
    for label, kind, implementation in configs:
        model, opt = make(kind) if kind == "dense" else make(kind, implementation)

        def closure(model=model, opt=opt):
            opt.zero_grad()
            loss = loss_fn(model)
            loss.backward()
            return loss

        runs[label] = (opt, closure)
    times: dict[str, list[float]] = {label: [] for label, *_ in configs}
    passes: dict[str, list[float]] = {label: [] for label, *_ in configs}
    for rep in range(repeats + 1):  # the first round warms up
        for label, (opt, closure) in runs.items():
            t = time.perf_counter()
            for _ in range(steps):
                opt.step(closure)
            if rep:
                times[label].append((time.perf_counter() - t) / steps * 1e3)
            t = time.perf_counter()  # the closure alone: forward and backward, no update
            for _ in range(steps):
                closure()
            if rep:
                passes[label].append((time.perf_counter() - t) / steps * 1e3)
    return {label: (statistics.median(times[label]), statistics.median(passes[label])) for label in times}


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", choices=("mlp", "gpt", "both"), default="both")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--steps", type=int, default=3, help="steps per timed block")
    a = p.parse_args(argv)
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, median of {a.repeats} "
          f"interleaved blocks of {a.steps} steps")
    print("| model | config | ms/step | ×dense | forward + backward ms | update ms (the rest) |")
    print("|---|---|---|---|---|---|")
    problems = {"mlp": _mlp_problem, "gpt": _gpt_problem}
    for name in (("mlp", "gpt") if a.model == "both" else (a.model,)):
        ms = measure(problems[name](), a.repeats, a.steps)
        for label, (v, fb) in ms.items():
            print(f"| {name} | {label} | {v:.1f} | {v / ms['dense'][0]:.2f} | {fb:.1f} | {v - fb:.1f} |")


if __name__ == "__main__":
    main()
