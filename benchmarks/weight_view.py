"""What the write-protected ``weight`` view costs foreign code that reads it.

A low-rank layer's ``weight`` is a :class:`rankwise.nn._view.DenseView` (writes into it
raise; reads return plain tensors). Measured side by side in one process, one thread, the two
variants interleaved over 5 rounds (each the median of 7 repeats), reported as the median
round: ``F.linear(x, layer.weight, layer.bias)`` (x 16 × 64, a 64 × 64 layer at rank 8)
and a low-rank ``nn.TransformerEncoderLayer`` (d 64, 4 heads, batch 4 × 16) in eval under
``no_grad`` (torch's fused kernel declines tensor subclasses, so the view sends it to the slow
path), against the same code with the view replaced by the plain tensor (what rankwise gave
before the view).

    .venv/bin/python benchmarks/weight_view.py
"""

from __future__ import annotations

import timeit

import torch
import torch.nn.functional as F
from torch import nn

import rankwise
from rankwise.nn import _attention, _base


def _median_us(fn, number: int) -> float:
    return sorted(timeit.repeat(fn, number=number, repeat=7))[3] / number * 1e6


def main() -> None:
    torch.set_num_threads(1)
    torch.manual_seed(0)
    layer = rankwise.to_low_rank(nn.Sequential(nn.Linear(64, 64)), rank=8)[0]
    enc = rankwise.to_low_rank(nn.TransformerEncoderLayer(64, 4, 128, batch_first=True), rank=8).eval()
    x, xe = torch.randn(16, 64), torch.randn(4, 16, 64)
    real = _base.as_view, _attention.as_view
    rows = {}
    for _ in range(5):  # interleaved: the view, then the plain tensor
        for tag in ("view", "plain"):
            if tag == "plain":
                _base.as_view = _attention.as_view = lambda t, *a: t
            try:
                with torch.no_grad():
                    lin = _median_us(lambda: F.linear(x, layer.weight, layer.bias), 2000)
                    encoder = _median_us(lambda: enc(xe), 300)
            finally:
                _base.as_view, _attention.as_view = real
            rows.setdefault(tag, []).append((lin, encoder))
    med = {tag: [sorted(col)[2] for col in zip(*r, strict=True)] for tag, r in rows.items()}
    print("| weight | F.linear(x, layer.weight) µs | low-rank encoder layer, eval no_grad µs |")
    print("|---|---|---|")
    for tag, label in (("view", "DenseView (rankwise)"), ("plain", "plain tensor (before)")):
        print(f"| {label} | {med[tag][0]:.1f} | {med[tag][1]:.0f} |")
    print(f"ratio view/plain: F.linear {med['view'][0] / med['plain'][0]:.2f}×, "
          f"encoder {med['view'][1] / med['plain'][1]:.2f}×")

if __name__ == "__main__":
    main()
