"""``torch.compile`` of a low-rank model while DLRT moves its ranks: graphs, recompiles and graph breaks.

What is measured
    ``rankwise.models.gpt(width=64, context=16, depth=2)`` converted at rank 8, with exact-shape
    factors (``capacity=None``) and with fixed-capacity factors (``capacity="auto"``: twice the
    rank), the model compiled with ``torch.compile`` (default dynamo settings, the backend given),
    trained `--steps` steps (default 30) by ``rankwise.DLRT`` (Adam, ``--tau`` 0.3, ``--lr`` 1e-2:
    the ranks move) on random byte windows, the optimizer in eager mode. Printed per layout: the
    distinct ranks seen, the unique graphs dynamo compiled, its graph breaks, and the wall time
    (compilation included), side by side in one run.

How to run
    .venv/bin/python benchmarks/compile_ranks.py                      # inductor, about 2 min on 2 cores
    .venv/bin/python benchmarks/compile_ranks.py --backend aot_eager  # dynamo + autograd only
"""

from __future__ import annotations

import argparse
import time

import torch
import torch._dynamo
from torch._dynamo.utils import counters

import rankwise
from rankwise.models import gpt


def run(capacity, steps: int, backend: str, tau: float, lr: float) -> dict:
    torch._dynamo.reset()
    counters.clear()
    torch.manual_seed(0)
    model = rankwise.to_low_rank(gpt(vocab=256, width=64, context=16, depth=2), rank=8, capacity=capacity)
    opt = rankwise.DLRT(model, lr, tau=tau, optimizer="adam")
    compiled = torch.compile(model, backend=backend)
    g = torch.Generator().manual_seed(1)
    data = torch.randint(0, 256, (4096,), generator=g)
    seen: set[int] = set()
    start = time.perf_counter()
    for _ in range(steps):
        i = torch.randint(0, len(data) - 17, (16,), generator=g)
        x = torch.stack([data[j:j + 16] for j in i])
        y = torch.stack([data[j + 1:j + 17] for j in i])

        def closure(x=x, y=y):
            opt.zero_grad()
            loss = torch.nn.functional.cross_entropy(compiled(x).flatten(0, 1), y.flatten())
            loss.backward()
            return loss

        opt.step(closure)
        seen |= set(opt.ranks().values())
    return {"ranks": len(seen), "graphs": counters["stats"]["unique_graphs"],
            "recompiles": counters["stats"]["unique_graphs"] - 1,
            "breaks": sum(counters["graph_break"].values()), "seconds": time.perf_counter() - start}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--backend", default="inductor")
    ap.add_argument("--tau", type=float, default=0.3)
    ap.add_argument("--lr", type=float, default=1e-2)
    a = ap.parse_args()
    print(f"torch {torch.__version__}, backend {a.backend}, {a.steps} DLRT steps, tau {a.tau}")
    print(f"{'layout':<16}{'distinct ranks':>15}{'graphs':>8}{'breaks':>8}{'seconds':>9}")
    for name, capacity in (("exact shapes", None), ("capacity auto", "auto")):
        r = run(capacity, a.steps, a.backend, a.tau, a.lr)
        print(f"{name:<16}{r['ranks']:>15}{r['graphs']:>8}{r['breaks']:>8}{r['seconds']:>9.1f}")


if __name__ == "__main__":
    main()
