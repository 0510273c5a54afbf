"""SDLRT vs DLRT on the same model: time per epoch and memory, side by side in one run.

Run: ``.venv/bin/python benchmarks/sdlrt_cost.py`` (about 2 min). For each task, DLRT and SDLRT
(τ = 0.2, same initial rank, same data order) train in alternation, one epoch at a time, for
``--epochs`` epochs each; the table gives the median epoch time of each and their ratio, and
the bytes of parameters + buffers + optimizer state at the end (SDLRT's compensation buffer is
a module buffer). The paper reports +30 MB and +0.65 s/epoch for VGG-19 on CIFAR.
"""

from __future__ import annotations

import argparse
import copy
import math
import statistics
import time

import torch
import torch.nn.functional as F

from rankwise import DLRT, SDLRT, to_low_rank
from rankwise.experiments.sweep import TASKS, _state_bytes


def epoch(model, opt, x, y, order, batch: int) -> float:
    t0 = time.perf_counter()
    for k in range(math.ceil(len(x) / batch)):
        idx = order[k * batch:(k + 1) * batch]

        def closure(idx=idx):
            opt.zero_grad()
            loss = F.cross_entropy(model(x[idx]), y[idx])
            loss.backward()
            return loss

        opt.step(closure)
    return time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tasks", default="lenet-digits,vgg-digits16,mlp-mnist1d")
    ap.add_argument("--epochs", type=int, default=5)
    ap.add_argument("--rank", type=int, default=32)
    a = ap.parse_args()
    torch.set_num_threads(1)
    print("| task | DLRT s/epoch | SDLRT s/epoch | ratio | DLRT state KiB | SDLRT state KiB "
          "| SDLRT − DLRT KiB |")
    print("|---|---|---|---|---|---|---|")
    for task in a.tasks.split(","):
        factory, loader = TASKS[task]
        x, y, _, _ = loader(0, None)
        torch.manual_seed(0)
        base = factory()
        runs = {}
        for name, cls in (("dlrt", DLRT), ("sdlrt", SDLRT)):
            m = copy.deepcopy(base)
            to_low_rank(m, rank=a.rank)
            runs[name] = (m, cls(m, 0.05, tau=0.2, momentum=0.9), [])
        g = torch.Generator().manual_seed(0)
        for _ in range(a.epochs):
            order = torch.randperm(len(x), generator=g)
            for m, opt, times in runs.values():
                times.append(epoch(m, opt, x, y, order, 64))
        (md, od, td), (ms, os_, ts) = runs["dlrt"], runs["sdlrt"]
        tdm, tsm = statistics.median(td), statistics.median(ts)
        bd, bs = _state_bytes(md, od) / 1024, _state_bytes(ms, os_) / 1024
        print(f"| {task} | {tdm:.2f} | {tsm:.2f} | {tsm / tdm:.2f} | {bd:.0f} | {bs:.0f} | {bs - bd:+.0f} |")


if __name__ == "__main__":
    main()
