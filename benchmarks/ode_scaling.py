"""KSL step time against the state size: the dense field path against the factored one, in
one run.

Run: ``.venv/bin/python benchmarks/ode_scaling.py`` (about a minute on 2 cores). The field is
:class:`rankwise.ode.MemoryField` (linear plus a rank-8 tanh term), batch 8, rank r = 8,
float32, m = n ∈ {64, 256, 1024}; the dense path is the same field called as f(t, F) (it forms
F, m×n per sample), the factored path computes the KSL projections from the factors. Times
are medians of 5 of one step (forward) and of one exact reverse step.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from rankwise.ode import LowRankState, MemoryField, ksl_reverse, ksl_step


def median_time(fn, repeats: int = 5) -> float:
    fn()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", default="64,256,1024")
    ap.add_argument("--rank", type=int, default=8)
    ap.add_argument("--batch", type=int, default=8)
    a = ap.parse_args()
    torch.set_num_threads(1)
    rows = []
    for m in (int(x) for x in a.sizes.split(",")):
        g = torch.Generator().manual_seed(0)
        field = MemoryField(m, m, 8, generator=g)
        F0 = torch.randn(a.batch, m, m, generator=g)
        st = LowRankState.from_dense(F0, a.rank)
        with torch.no_grad():
            one = ksl_step(st, field, 0.0, 0.05)
            row = dict(m=m)
            dense = lambda t, F, field=field: field(t, F)  # noqa: E731  (not a FactoredField: forms F)
            for name, f in (("dense", dense), ("factored", field)):
                row[name] = median_time(lambda f=f, st=st: ksl_step(st, f, 0.0, 0.05))
                row[name + "_rev"] = median_time(lambda f=f, one=one: ksl_reverse(one, f, 0.0, 0.05))
        rows.append(row)
    print(f"KSL step of MemoryField (p = 8), batch {a.batch}, rank {a.rank}, float32, one thread\n")
    print("| m = n | dense step (ms) | factored step (ms) | dense / factored | dense reverse (ms) "
          "| factored reverse (ms) | factored step time / previous size's |")
    print("|---|---|---|---|---|---|---|")
    for i, r in enumerate(rows):
        growth = "" if i == 0 else (f"{r['factored'] / rows[i - 1]['factored']:.2f} "
                                    f"(m grew {r['m'] / rows[i - 1]['m']:.0f}×)")
        print(f"| {r['m']} | {1e3 * r['dense']:.2f} | {1e3 * r['factored']:.2f} | "
              f"{r['dense'] / r['factored']:.1f} | {1e3 * r['dense_rev']:.2f} | "
              f"{1e3 * r['factored_rev']:.2f} | {growth} |")


if __name__ == "__main__":
    main()
