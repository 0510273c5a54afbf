"""Greedy generation with a low-rank T5, whose blocks read ``wo.weight.dtype`` on every call,
with the weight view kept between reads (rankwise now) against formed on every read (before).

A T5 built from a config (no download: d_model 256, d_ff 1024, 4 + 4 layers, 4 heads, random
weights), every projection converted at rank 32; 32 new tokens from a 32-token prompt under
``no_grad``, one thread. The two variants interleaved over 5 rounds, each the median of 3
generations, reported as the median round and the ratio.

    .venv/bin/python benchmarks/t5_generate.py
"""

from __future__ import annotations

import os
import time

import torch

import rankwise
from rankwise.nn._base import AbstractLowRankLayer


def main() -> None:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import transformers

    torch.set_num_threads(1)
    torch.manual_seed(0)
    cfg = transformers.T5Config(vocab_size=512, d_model=256, d_ff=1024, num_layers=4, num_decoder_layers=4,
                                num_heads=4, d_kv=64, decoder_start_token_id=0, pad_token_id=0,
                                eos_token_id=1)
    model = rankwise.to_low_rank(transformers.T5ForConditionalGeneration(cfg).eval(), rank=32)
    ids = torch.randint(2, 512, (1, 32), generator=torch.Generator().manual_seed(0))

    def generate() -> float:
        t = time.perf_counter()
        with torch.no_grad():
            model.generate(ids, max_new_tokens=32, min_new_tokens=32, do_sample=False)
        return time.perf_counter() - t

    kept, every = AbstractLowRankLayer.weight, property(AbstractLowRankLayer._view)
    rounds: dict[str, list[float]] = {"kept": [], "every read": []}
    generate()  # warm-up
    for _ in range(5):
        for tag, prop in (("kept", kept), ("every read", every)):
            AbstractLowRankLayer.weight = prop
            try:
                rounds[tag].append(sorted(generate() for _ in range(3))[1])
            finally:
                AbstractLowRankLayer.weight = kept
    med = {k: sorted(v)[2] for k, v in rounds.items()}
    for k, v in med.items():
        print(f"{k:>10}: {v * 1e3:7.1f} ms per generation")
    print(f"every read / kept: {med['every read'] / med['kept']:.2f}x")


if __name__ == "__main__":
    main()
