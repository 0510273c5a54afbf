"""Peak memory and time of reversal backprop vs autograd through the whole stored graph, for the
same LowRankODEBlock (C = 8 checkpoint spacing, 64 steps), in one run.

Run: ``.venv/bin/python benchmarks/ode_memory.py`` (about a minute). Each variant runs in a fresh
subprocess; peak memory is that process's maximum resident set size minus its size just
before the forward pass (so the interpreter and torch themselves are not counted).
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import time


def child(mode: str, batch: int, m: int, n: int, rank: int, steps: int) -> dict:
    import torch
    from torch import nn

    from rankwise.ode import FixedController, LowRankODEBlock

    torch.manual_seed(0)

    class Field(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.A = nn.Parameter(0.1 * torch.randn(m, m))
            self.B = nn.Parameter(0.1 * torch.randn(n, n))

        def forward(self, t, F):
            return torch.tanh(self.A @ F @ self.B.T) - 0.1 * F

    block = LowRankODEBlock(Field(), rank=rank, steps=steps, h=0.02, controller=FixedController(8, rank),
                            reversible=(mode == "reversal"))
    x = torch.randn(batch, m, n)
    if mode == "autograd":  # the stored-graph reference follows the same (fixed) schedule
        block.reversible = True
        with torch.no_grad():
            block(x)
        block.reversible = False
    base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    t0 = time.perf_counter()
    out = block(x.requires_grad_(True))
    (out.dense() ** 2).sum().backward()
    dt = time.perf_counter() - t0
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return {"mode": mode, "seconds": dt, "peak_mib": (peak - base) / 1024}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--m", type=int, default=128)
    ap.add_argument("--n", type=int, default=128)
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--steps", type=int, default=64)
    ap.add_argument("--child", default=None)
    args = ap.parse_args()
    dims = (args.batch, args.m, args.n, args.rank, args.steps)
    if args.child:
        print(json.dumps(child(args.child, *dims)))
        return
    res = {}
    for mode in ("autograd", "reversal"):
        cmd = [sys.executable, __file__, "--child", mode, "--batch", str(args.batch), "--m", str(args.m),
               "--n", str(args.n), "--rank", str(args.rank), "--steps", str(args.steps)]
        res[mode] = json.loads(subprocess.run(cmd, check=True, capture_output=True, text=True).stdout)
    a, r = res["autograd"], res["reversal"]
    print(f"batch {args.batch}, F {args.m}×{args.n}, rank {args.rank}, {args.steps} steps, C = 8, float32\n")
    print("| backprop | peak memory above baseline (MiB) | forward+backward (s) |")
    print("|---|---|---|")
    print(f"| autograd through the stored graph | {a['peak_mib']:.1f} | {a['seconds']:.2f} |")
    print(f"| reversal from checkpoints | {r['peak_mib']:.1f} | {r['seconds']:.2f} |")
    print(f"| ratio (targets: memory ≤ 0.25, time ≤ 2.0) | {r['peak_mib'] / a['peak_mib']:.3f} | "
          f"{r['seconds'] / a['seconds']:.2f} |")


if __name__ == "__main__":
    main()
