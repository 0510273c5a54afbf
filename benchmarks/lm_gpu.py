"""Issue 48's GPU protocol: the LLaMA-style model at LLaMA-60M's shape, trained from scratch on
BBC News bytes by dense AdamW, dense Muon and rankwise's low-rank methods, side by side.

What is measured
    For each method, on one device, the same windows in the same order (seed 0) and the same
    schedule, clipping and rate handling as ``rankwise lm`` (docs/lm.md): the final validation
    bits per token on `--val-windows` windows spaced through the validation split, the tokens
    per second of the whole run (``torch.cuda.synchronize()`` before the clock stops), the
    training-state count of ``rankwise.training_memory`` at the end of the run (weights,
    gradients, optimizer state, buffers) and, on CUDA, ``torch.cuda.max_memory_allocated``
    (the peak, activations and the integrator's working memory included). A ratio column
    compares each row's bits and memory with the first row's (dense AdamW by default).

    Model: ``rankwise.models.llama`` at width 512, 8 blocks, 8 heads (LLaMA-60M's hidden size,
    depth and heads; its SwiGLU hidden width 1368, against LLaMA-60M's 1376), context 256, with
    a byte vocabulary (257 tokens) instead of LLaMA's 32,000, so about 25 M parameters, nearly
    all in the projections. Batch 32 windows (8,192 tokens a step).

    Rates: `--lr method=rate,...` (default: each method's rate chosen on the CPU study of
    docs/lm.md); a GPU study chooses them again on validation, e.g. by running this at 3 rates
    per method with `--steps` shortened.

How to run
    PYTHONPATH=src python benchmarks/lm_gpu.py                      # CUDA; 2,000 steps per method
    PYTHONPATH=src python benchmarks/lm_gpu.py --steps 300 --methods dense,dlrt-reset
    .venv/bin/python benchmarks/lm_gpu.py --device cpu --small      # the same code on the CPU, tiny
"""

from __future__ import annotations

import argparse
import math
import platform
import sys
import time

import torch
import torch.nn.functional as F

import rankwise
from rankwise.data._bytes import load_bbc_text, random_windows, sequential_windows
from rankwise.experiments.lm import lm_compare
from rankwise.experiments.lm._lm_spec import DENSE, LmRunSpec
from rankwise.methods import REGISTRY
from rankwise.train import fit

# each method's rate as chosen on validation in docs/lm.md's CPU study (LLaMA-style, 1,500 steps)
RATES = {"dense": 1e-3, "muon": 3e-3, "dlrt": 3e-3, "dlrt-reset": 1e-2, "dlrt-muon": 3e-3,
         "dlrt-muon-reset": 1e-2, "cola": 3e-3, "fixed": 3e-3}


def run(method: str, args: argparse.Namespace, lr: float) -> dict:
    """Train one method; returns its measures."""
    if REGISTRY[method].warm:
        raise SystemExit(f"{method}: the warm methods switch optimizers mid-run; use rankwise lm for them")
    spec = LmRunSpec(method=method, compression=0.0 if method in DENSE else args.compression, lr=lr,
                     steps=args.steps, batch=args.batch, context=args.context, width=args.width,
                     depth=args.depth, heads=args.heads, model="llama", clip=1.0)
    dev = torch.device(args.device)
    cuda = dev.type == "cuda"
    with dev:  # every tensor the model and its optimizer create, on the device
        model, opt, _ = lm_compare.build(spec)
    data = load_bbc_text()
    x, y = random_windows(data.train, spec.steps * spec.batch, spec.context, torch.Generator().manual_seed(0))
    vx, vy = lm_compare.spaced(*sequential_windows(data.val, spec.context), args.val_windows)
    x, y, vx, vy = (t.to(dev) for t in (x, y, vx, vy))
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    t0 = time.perf_counter()
    failed = None
    try:
        fit(model, opt, x, y, epochs=1, batch_size=spec.batch, max_steps=spec.steps, shuffle=None,
            loss_fn=lambda out, t: F.cross_entropy(out.flatten(0, 1), t.flatten()),
            callbacks=[lm_compare._Schedule(spec)], clip_grad_norm=spec.clip)
    except FloatingPointError as e:  # a diverged rate
        failed = str(e)
    if cuda:
        torch.cuda.synchronize()
    seconds = time.perf_counter() - t0
    bits = math.inf if failed else lm_compare._bits(model, vx, vy)
    tokens = spec.steps * spec.batch * spec.context
    return {"method": method, "lr": lr, "bits": bits, "tokens_s": tokens / seconds,
            "state_mib": rankwise.training_memory(model, opt).total / 2**20,
            "peak_mib": torch.cuda.max_memory_allocated() / 2**20 if cuda else math.nan,
            "params": sum(p.numel() for p in model.parameters()), "failed": failed}


def main(argv: list[str] | None = None) -> list[dict]:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--methods", default="dense,muon,dlrt-reset,dlrt-muon-reset,cola")
    p.add_argument("--lr", default="", help="method=rate,... (others: the CPU study's rates)")
    p.add_argument("--compression", type=float, default=0.5)
    p.add_argument("--steps", type=int, default=2000)
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--context", type=int, default=256)
    p.add_argument("--width", type=int, default=512)
    p.add_argument("--depth", type=int, default=8)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--val-windows", type=int, default=512)
    p.add_argument("--small", action="store_true", help="a tiny model and run (a check of the code)")
    args = p.parse_args(argv)
    if args.small:
        args.steps, args.batch, args.context, args.width, args.depth, args.heads, args.val_windows = (
            3, 2, 16, 32, 1, 2, 4)
    methods = [m for m in args.methods.split(",") if m]
    if unknown := [m for m in methods if m not in RATES]:
        raise SystemExit(f"--methods: unknown {unknown}; one of {sorted(RATES)}")
    rates = dict(RATES)
    for item in filter(None, args.lr.split(",")):
        name, _, value = item.partition("=")
        rates[name] = float(value)
    torch.manual_seed(0)
    rows = [run(m, args, rates[m]) for m in methods]
    dev = torch.cuda.get_device_name() if args.device.startswith("cuda") else platform.processor() or "cpu"
    print(f"# lm_gpu: {dev}, torch {torch.__version__}; llama width {args.width}, depth {args.depth}, "
          f"context {args.context}, batch {args.batch}, {args.steps} steps, compression {args.compression}, "
          f"{rows[0]['params']:,} parameters (dense)")
    print("| method | lr | val bits | bits vs first | tokens/s | state MiB | vs first | peak MiB "
          "| vs first |")
    print("|---|---|---|---|---|---|---|---|---|")
    first = rows[0]
    for r in rows:
        print(f"| {r['method']} | {r['lr']:g} | {r['bits']:.3f} | {r['bits'] / first['bits']:.3f} | "
              f"{r['tokens_s']:.0f} | {r['state_mib']:.1f} | {r['state_mib'] / first['state_mib']:.2f} | "
              f"{r['peak_mib']:.0f} | {r['peak_mib'] / first['peak_mib']:.2f} |")
    return rows


if __name__ == "__main__":
    main(sys.argv[1:])
