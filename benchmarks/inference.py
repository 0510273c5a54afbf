"""Inference cost: a dense model vs its exported low-rank version at ~90 % compression.

What is measured
    For each model, one dense instance (default PyTorch initialisation) and its low-rank copy:
    ``rankwise.to_low_rank`` with a rank per layer, then ``rankwise.export`` (plain
    ``nn.Linear`` / ``nn.Conv2d`` pairs, ``merge="auto"``). Compression = 1 − stored params /
    dense params, counted on the actual modules (all parameters, biases included). The ranks
    give every compressed layer the same compression c' (r = (1−c')·in·out / (in+out), in =
    C_in·kh·kw for a conv), with c' chosen so the whole model is as close to ``--compression``
    as integer ranks allow; layers holding < 1 % of the weights (first conv, class heads) stay
    dense: compressing them saves nothing measurable. The achieved compression is printed.

    Per model: parameter count and the size in bytes of ``torch.save(model.state_dict())``.
    Per model and batch size: median forward latency (ms) under ``torch.inference_mode``, of
    the dense model, the exported low-rank model, and (for reference) the un-exported rankwise
    model. Timing is interleaved: after a warm-up, each repeat runs one block of calls per
    variant in a freshly shuffled order, so machine noise hits all alike; a block is as many
    calls as fit in about ``--block-seconds`` (at least one). Before timing, the exported
    model's outputs are checked against the rankwise model's (relative max error < 1e-4).

    Models: an MLP with 4 layers 2048→2048 and a dense 2048→10 head (``rankwise.models.mlp``),
    LeNet-5 for 28×28 inputs (``lenet(size=28)``) and a VGG-style CNN for 3×32×32 inputs
    (``vgg(3, 32, width=32)``), at batch 1 and 256, float32.

How to run
    .venv/bin/python benchmarks/inference.py              # full (~2-3 min on 2 cores, 1 thread)
    .venv/bin/python benchmarks/inference.py --quick      # small models, smoke test (seconds)
    .venv/bin/python benchmarks/inference.py --threads 2 --compression 0.8
"""

from __future__ import annotations

import argparse
import copy
import os
import platform
import random
import shlex
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from torch import Tensor, nn

import rankwise
from rankwise.models import lenet, mlp, vgg
from rankwise.nn import export

SMALL_LAYER = 0.01  # layers with less than this fraction of the weights stay dense
AGREE_TOL = 1e-4  # max |exported − rankwise| / max |rankwise|, float32


@dataclass(frozen=True)
class Spec:
    """A benchmarked model: its name, a builder of the dense model and one sample's shape."""

    name: str
    build: Callable[[], nn.Module]
    sample_shape: tuple[int, ...]


def specs(quick: bool) -> list[Spec]:
    if quick:
        return [
            Spec("mlp 4×256 + head", lambda: mlp(256, 256, depth=5), (256,)),
            Spec("lenet(size=8)", lambda: lenet(size=8), (1, 8, 8)),
        ]
    return [
        Spec("mlp 4×2048 + head", lambda: mlp(2048, 2048, depth=5), (2048,)),
        Spec("lenet(size=28)", lambda: lenet(size=28), (1, 28, 28)),
        Spec("vgg(3, 32, width=32)", lambda: vgg(3, 32, width=32), (3, 32, 32)),
    ]


# ----------------------------------------------------------------------------- ranks
def weight_shapes(model: nn.Module) -> dict[str, tuple[int, int]]:
    """{name: (out, in)} of every nn.Linear / nn.Conv2d weight viewed as a matrix."""
    return {n: (m.weight.shape[0], m.weight[0].numel())
            for n, m in model.named_modules() if isinstance(m, (nn.Linear, nn.Conv2d))}


def rank_at(out: int, inp: int, c: float) -> int:
    """The rank giving one layer compression ≈ c: r·(in+out) ≈ (1−c)·in·out, in [1, min(in, out)]."""
    return max(1, min(min(out, inp), round((1 - c) * out * inp / (out + inp))))


def stored(shapes: dict[str, tuple[int, int]], ranks: dict[str, int]) -> int:
    """Weight entries after export with merge="auto": min(r·(in+out), in·out) per layer, in·out
    for layers without a rank."""
    total = 0
    for name, (o, i) in shapes.items():
        r = ranks.get(name)
        total += o * i if r is None else min(r * (o + i), o * i)
    return total


def choose_ranks(shapes: dict[str, tuple[int, int]], other: int, target: float) -> dict[str, int]:
    """Ranks for the layers holding ≥ SMALL_LAYER of the weights, all at one per-layer
    compression c', with c' on a fine grid chosen so that 1 − (stored + other)/(dense + other)
    is closest to `target`. `other`: parameters outside the weights (biases, ...)."""
    weights = sum(o * i for o, i in shapes.values())
    big = [n for n, (o, i) in shapes.items() if o * i >= SMALL_LAYER * weights]
    dense = weights + other

    def ranks_for(c: float) -> dict[str, int]:
        return {n: rank_at(*shapes[n], c) for n in big}

    grid = [k / 2000 for k in range(2001)]
    best = min(grid, key=lambda c: abs(1 - (stored(shapes, ranks_for(c)) + other) / dense - target))
    return ranks_for(best)


def n_params(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


def low_rank_copy(dense: nn.Module, ranks: dict[str, int]) -> nn.Module:
    """A rankwise copy of `dense` with layer `name` at rank `ranks[name]` (truncated SVD)."""
    model = copy.deepcopy(dense)
    for name, r in ranks.items():
        rankwise.to_low_rank(model, rank=r, include=[name])
    return model


def state_dict_bytes(model: nn.Module) -> int:
    """Size of ``torch.save(model.state_dict())`` on disk."""
    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "sd.pt")
        torch.save(model.state_dict(), path)
        return os.path.getsize(path)


@torch.inference_mode()
def check_agreement(exported: nn.Module, low_rank: nn.Module, x: Tensor) -> float:
    """Relative max error of the exported model against the rankwise one; raises above AGREE_TOL."""
    a, b = exported(x), low_rank(x)
    err = float((a - b).abs().max() / b.abs().max().clamp_min(1e-30))
    if not err < AGREE_TOL:
        raise RuntimeError(f"exported and low-rank outputs disagree: relative error {err:.2e}")
    return err


# ----------------------------------------------------------------------------- timing
def _block(fn: Callable[[], object], n: int) -> float:
    t0 = time.perf_counter()
    for _ in range(n):
        fn()
    return (time.perf_counter() - t0) / n


@torch.inference_mode()
def median_ms(fns: dict[str, Callable[[], object]], *, repeats: int, block_seconds: float,
              warmup: int, seed: int) -> dict[str, float]:
    """Median (over `repeats`) ms per call of each fn, blocks interleaved in shuffled order."""
    calls = {}
    for name, fn in fns.items():
        for _ in range(warmup):
            fn()
        calls[name] = max(1, round(block_seconds / max(_block(fn, 1), 1e-7)))
    times: dict[str, list[float]] = {name: [] for name in fns}
    rng = random.Random(seed)
    order = list(fns)
    for _ in range(repeats):
        rng.shuffle(order)
        for name in order:
            times[name].append(_block(fns[name], calls[name]))
    return {name: 1e3 * statistics.median(t) for name, t in times.items()}


# ----------------------------------------------------------------------------- report
@dataclass
class Row:
    model: str
    batch: int
    params: tuple[int, int]  # dense, exported
    nbytes: tuple[int, int]
    ms: tuple[float, float, float]  # dense, exported, rankwise


HEADER = ("| model | batch | params dense | params low-rank | ratio | bytes dense | bytes low-rank | ratio "
          "| ms dense | ms low-rank | ratio | ms rankwise (not exported) |")


def table(rows: Sequence[Row]) -> str:
    lines = [HEADER, "|" + "---|" * HEADER.count(" | ") + "---|"]
    for r in rows:
        lines.append(
            f"| {r.model} | {r.batch} | {r.params[0]:,} | {r.params[1]:,} | {r.params[1] / r.params[0]:.3f} "
            f"| {r.nbytes[0]:,} | {r.nbytes[1]:,} | {r.nbytes[1] / r.nbytes[0]:.3f} "
            f"| {r.ms[0]:.3f} | {r.ms[1]:.3f} | {r.ms[1] / r.ms[0]:.3f} | {r.ms[2]:.3f} |"
        )
    return "\n".join(lines)


def bench_model(spec: Spec, args: argparse.Namespace) -> list[Row]:
    """Build, compress, export, check and time one model; one Row per batch size."""
    dense = spec.build().eval()
    shapes = weight_shapes(dense)
    other = n_params(dense) - sum(o * i for o, i in shapes.values())
    ranks = choose_ranks(shapes, other, args.compression)
    low_rank = low_rank_copy(dense, ranks).eval()
    exported = export(low_rank).eval()
    params = (n_params(dense), n_params(exported))
    nbytes = (state_dict_bytes(dense), state_dict_bytes(exported))
    print(f"{spec.name}: ranks {ranks}, compression {1 - params[1] / params[0]:.4f} "
          f"(rankwise model: {rankwise.compression(low_rank)['ratio']:.4f})", flush=True)
    rows = []
    for batch in args.batches:
        x = torch.randn(batch, *spec.sample_shape)
        err = check_agreement(exported, low_rank, x)
        ms = median_ms({"dense": lambda x=x: dense(x), "exported": lambda x=x: exported(x),
                        "rankwise": lambda x=x: low_rank(x)},
                       repeats=args.repeats, block_seconds=args.block_seconds, warmup=args.warmup,
                       seed=args.seed)
        print(f"  batch {batch}: outputs agree (rel. err {err:.1e}); dense {ms['dense']:.3f} ms, "
              f"exported {ms['exported']:.3f} ms, rankwise {ms['rankwise']:.3f} ms", flush=True)
        rows.append(Row(spec.name, batch, params, nbytes, (ms["dense"], ms["exported"], ms["rankwise"])))
    return rows


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="small models, few repeats: a smoke test")
    p.add_argument("--threads", type=int, default=1, help="torch.set_num_threads (default 1)")
    p.add_argument("--compression", type=float, default=0.9, help="target 1 − stored/dense (default 0.9)")
    p.add_argument("--batches", type=int, nargs="+", default=[1, 256])
    p.add_argument("--repeats", type=int, default=None, help="timed blocks per variant (default 15; quick 3)")
    p.add_argument("--block-seconds", type=float, default=None, help="seconds per block (default 0.2)")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    if not 0.0 < args.compression < 1.0:
        p.error(f"--compression must be in (0, 1); got {args.compression}")
    args.repeats = args.repeats or (3 if args.quick else 15)
    args.block_seconds = args.block_seconds or (0.01 if args.quick else 0.2)
    args.warmup = 1 if args.quick else 3
    return args


def main(argv: Sequence[str] | None = None) -> str:
    """Run the benchmark; print and return the markdown table."""
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    command = shlex.join(sys.orig_argv) if argv is None else shlex.join(["inference.py", *argv])
    print(f"command: {command}")
    print(f"torch {torch.__version__}, python {platform.python_version()}, {platform.machine()}, "
          f"{torch.get_num_threads()} thread(s), float32, target compression {args.compression}", flush=True)
    t0 = time.perf_counter()
    rows = [row for spec in specs(args.quick) for row in bench_model(spec, args)]
    out = table(rows)
    print()
    print(out)
    print(f"\n(ratios: low-rank / dense; total time {time.perf_counter() - t0:.0f} s)")
    return out


if __name__ == "__main__":
    main()
