"""What fixed-capacity factors cost against exact shapes: training memory, step time, and whether a
parameter ever moves, on the LM recipe, side by side in one run.

What is measured
    The LLaMA-style model of docs/lm.md (``--width`` 128, ``--context`` 64, 4 blocks) on BBC News
    bytes, every projection factorised at compression 0.5 (rank ``rank_for``), trained ``--steps``
    (default 50) by the recipe ``dlrt-muon-reset`` (:mod:`rankwise.methods`: DLRT, the Muon rule on
    the factors, moments restarted at each truncation, a budget of the start ranks' parameters),
    learning rate 3e-3, 16 windows a step; dense AdamW on the same model beside it. Layouts: exact
    shapes (``capacity=None``) and fixed capacity R = ceil(f·r) for each factor f of ``--factors``
    (r: the layer's start rank; ``capacity="auto"`` is f = 2). Printed per layout: the counted
    training memory (``rankwise.training_memory``: weights, gradients, optimizer state) over dense
    AdamW's, the median step time over the last half of the steps, how many layers sat at their
    capacity at the end, how many times a layer's rank changed, whether any parameter's shape or
    storage changed, and the final training loss.

How to run
    .venv/bin/python benchmarks/fixed_capacity.py                  # about 2 min on 2 cores
    .venv/bin/python benchmarks/fixed_capacity.py --factors 2 --steps 200 --width 256
"""

from __future__ import annotations

import argparse
import math
import statistics
import time

import torch
import torch.nn.functional as F

import rankwise
from rankwise.data._bytes import load_bbc_text, random_windows
from rankwise.experiments.lm._lm_spec import ADAM, LmRunSpec
from rankwise.experiments.lm.lm_compare import optimizer_for, projections, rank_for
from rankwise.models import llama


def build(spec: LmRunSpec, factor: float | None):
    torch.manual_seed(0)
    model = llama(context=spec.context, width=spec.width, depth=spec.depth, heads=spec.heads)
    if factor is None:
        return model, torch.optim.AdamW(model.parameters(), lr=spec.lr, **ADAM)
    ranks = {n: rank_for(m.out_features, m.in_features, spec.compression)
             for n, m in projections(model).items()}
    rankwise.to_low_rank(model, rank=ranks)
    if factor > 0:
        for m in model.modules():
            if isinstance(m, rankwise.LowRankLinear):
                m.set_capacity(math.ceil(factor * m.rank))
    return model, optimizer_for(model, spec, {})


def run(spec: LmRunSpec, factor: float | None, stream: torch.Tensor) -> dict:
    model, opt = build(spec, factor)
    layers = [m for m in model.modules() if isinstance(m, rankwise.LowRankLinear)]
    where = [(tuple(p.shape), p.data_ptr()) for p in model.parameters()]
    g = torch.Generator().manual_seed(1)
    times, changes, memory = [], 0, 0
    before = [m.rank for m in layers]
    for _ in range(spec.steps):
        x, y = random_windows(stream, spec.batch, spec.context, g)

        def closure(x=x, y=y):
            opt.zero_grad()
            loss = F.cross_entropy(model(x).flatten(0, 1), y.flatten())
            loss.backward()
            return loss

        start = time.perf_counter()
        loss = opt.step(closure)
        times.append(time.perf_counter() - start)
        memory = max(memory, rankwise.training_memory(model, opt).total)
        now = [m.rank for m in layers]
        changes += sum(a != b for a, b in zip(before, now, strict=True))
        before = now
    moved = where != [(tuple(p.shape), p.data_ptr()) for p in model.parameters()]
    full = sum(m.capacity is not None and m.rank == m.capacity for m in layers)
    return {"memory": memory, "time": statistics.median(times[len(times) // 2:]), "full": full,
            "layers": len(layers), "changes": changes, "moved": moved, "loss": float(loss.detach())}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, default=50)
    ap.add_argument("--width", type=int, default=128)
    ap.add_argument("--context", type=int, default=64)
    ap.add_argument("--factors", default="1.25,1.5,2")
    a = ap.parse_args()
    torch.set_num_threads(1)
    spec = LmRunSpec(method="dlrt-muon-reset", compression=0.5, model="llama", width=a.width,
                     context=a.context, steps=a.steps, lr=3e-3)
    stream = load_bbc_text().train
    rows = [("dense AdamW", None), ("exact shapes", 0.0)]
    rows += [(f"capacity {f}×r", float(f)) for f in a.factors.split(",")]
    print(f"torch {torch.__version__}, 1 thread, llama width {a.width} context {a.context}, {a.steps} "
          "steps, dlrt-muon-reset at compression 0.5")
    print(f"{'layout':<18}{'memory/dense':>13}{'step ms':>9}{'at cap':>8}{'changes':>9}{'moved':>7}"
          f"{'loss':>8}")
    dense = None
    for name, factor in rows:
        r = run(spec, factor, stream)
        dense = dense or r["memory"]
        cap = "-" if not factor else f"{r['full']}/{r['layers']}"
        low = factor is not None
        print(f"{name:<18}{r['memory'] / dense:>13.3f}{1e3 * r['time']:>9.1f}{cap:>8}"
              f"{r['changes'] if low else '-':>9}{str(r['moved']) if low else '-':>7}{r['loss']:>8.3f}")


if __name__ == "__main__":
    main()
