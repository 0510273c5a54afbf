"""The integrator's orthogonalisation of many same-shape layers: one batched call
(``rankwise.linalg.orth_complement_batched``) against a loop of single calls
(``orth_complement``), side by side in one process, interleaved, median of ``--repeats``.

How to run
    .venv/bin/python benchmarks/batched_orth.py            # ~30 s on 2 cores
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from rankwise.linalg import orth_complement, orth_complement_batched

CASES = [(24, 384, 19), (36, 384, 8), (8, 64, 4), (8, 1024, 52), (8, 2048, 100), (8, 2048, 195)]
"""(pairs, m, r): bases (m, r) and updates (m, r), as an augmentation of rank-r layers of width m."""


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--repeats", type=int, default=15)
    args = p.parse_args()
    torch.manual_seed(0)
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads; median of {args.repeats}")
    head = ("pairs", "m", "r", "m(k+c)c", "loop ms", "batched ms", "batched/loop")
    print(" ".join(f"{h:>{w}}" for h, w in zip(head, (5, 5, 4, 11, 8, 10, 12), strict=True)))
    for n, m, r in CASES:
        Q = torch.linalg.qr(torch.randn(n, m, r))[0]
        X = torch.randn(n, m, r) * 1e-2
        fns = {"loop": lambda Q=Q, X=X: [orth_complement(q, x) for q, x in zip(Q, X, strict=True)],
               "batched": lambda Q=Q, X=X: orth_complement_batched(Q, X)}
        times: dict[str, list[float]] = {k: [] for k in fns}
        for f in fns.values():
            f()
        for _ in range(args.repeats):
            for k, f in fns.items():
                t0 = time.perf_counter()
                f()
                times[k].append(time.perf_counter() - t0)
        loop, batched = (statistics.median(times[k]) * 1e3 for k in ("loop", "batched"))
        print(f"{n:>5} {m:>5} {r:>4} {m * 2 * r * r:>11,} {loop:>8.2f} {batched:>10.2f} "
              f"{batched / loop:>12.2f}")


if __name__ == "__main__":
    main()
