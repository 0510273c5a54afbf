"""Reversal defect δ of the KSL step: exact reverse vs the naive substeps-at-−h reverse, against
step size h, core conditioning σ_min and dtype, for a linear and a nonlinear matrix field.

Run: ``.venv/bin/python benchmarks/ode_defect.py`` (a few seconds). Prints one markdown table.
"""

from __future__ import annotations

import numpy as np
import torch

from rankwise.ode import LowRankState, ksl_step, reversal_defect

HS = (0.1, 0.05, 0.025)


def fields(m: int, n: int):
    g = torch.Generator().manual_seed(0)
    A = 0.3 * torch.randn(m, m, generator=g, dtype=torch.float64)
    B = 0.3 * torch.randn(n, n, generator=g, dtype=torch.float64)
    return {
        "linear F' = AF + FBᵀ (seed's toy)": lambda t, F: A @ F + F @ B.T,
        "nonlinear tanh(AFBᵀ) − 0.1F + 0.05FFᵀF": lambda t, F: torch.tanh(A @ F @ B.T) - 0.1 * F
        + 0.05 * F @ F.mT @ F,
    }


def naive_defect(st: LowRankState, field, h: float) -> float:
    back = ksl_step(ksl_step(st, field, 0.0, h), field, h, -h)
    F = st.dense()
    return float((torch.linalg.matrix_norm(back.dense() - F) / torch.linalg.matrix_norm(F)).max())


def main() -> None:
    m, n, r, batch = 16, 12, 6, 4
    print(f"m={m}, n={n}, nominal rank {r}, batch {batch}; S = diag(1, 0.8, 0.6, 0.4, σ_min, σ_min); "
          f"max over the batch; h = {HS}\n")
    print("| field | dtype | σ_min | δ exact reverse (per h) | δ naive −h (per h) | naive log-log slope |")
    print("|---|---|---|---|---|---|")
    for name, f64_field in fields(m, n).items():
        for dt in (torch.float64, torch.float32):
            field = lambda t, F, f=f64_field: f(t, F.double()).to(F.dtype)  # noqa: E731
            g = torch.Generator().manual_seed(1)
            X = torch.linalg.qr(torch.randn(batch, m, r, generator=g, dtype=dt))[0]
            V = torch.linalg.qr(torch.randn(batch, n, r, generator=g, dtype=dt))[0]
            for smin in (1e-1, 1e-4, 1e-8, 0.0):
                sig = torch.tensor([1, 0.8, 0.6, 0.4, smin, smin], dtype=dt)
                S = torch.diag_embed(sig).expand(batch, r, r)
                st = LowRankState(X, S, V)
                exact = [float(reversal_defect(st, field, 0.0, h).max()) for h in HS]
                naive = [naive_defect(st, field, h) for h in HS]
                slope = np.polyfit(np.log(HS), np.log(naive), 1)[0]
                print(f"| {name} | {str(dt)[6:]} | {smin:g} | " + " / ".join(f"{d:.1e}" for d in exact)
                      + " | " + " / ".join(f"{d:.1e}" for d in naive) + f" | {slope:.2f} |")


if __name__ == "__main__":
    main()
