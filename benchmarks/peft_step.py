"""What a rank-adaptive adapter step costs against a LoRA step: every ``rankwise peft`` method on
MiniLM-L6 (query/key/value, classifier head trained), side by side in one run.

The models and optimizers are the comparison's own (``rankwise.experiments.peft.peft_compare``):
LoRA, LoRA at rank 20, AdaLoRA (with ``update_and_allocate``) and LoRA+ through ``peft``;
DLRT / SDLRT adapters on LoRA r10's parameter budget and, as ``*-cap2r``, at τ = 0.02 capped at
rank 20, all with the integrator's Adam; and, with ``--update-every K``, DLRT / SDLRT running
the basis update and truncation every K-th step only. One step = zero_grad, forward, backward,
optimizer step (and AdaLoRA's hook), on BBC News batches of ``--batch`` articles × ``--max-len``
tokens.

Every configuration first takes ``--warmup`` steps, then the timed blocks are interleaved
(lora, lora-2r, …, lora, …) and each figure is the median over ``--repeats`` blocks of
``--steps`` steps. Usage: ``python benchmarks/peft_step.py``.
"""

from __future__ import annotations

import argparse
import platform
import statistics
import time

import torch
import torch.nn.functional as F

from rankwise.experiments.peft.peft_compare import METHODS, PeftRunSpec, _build, _data, _ranks_and_params


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--max-len", type=int, default=64)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--steps", type=int, default=3, help="steps per timed block")
    p.add_argument("--repeats", type=int, default=7, help="timed blocks per configuration")
    p.add_argument("--threads", type=int, default=1, help="torch threads (the comparison's jobs use 1)")
    p.add_argument("--update-every", type=int, default=0, help="also time DLRT/SDLRT updating every K steps")
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    ids, mask, y, split = _data(args.max_len)
    train = torch.tensor(split["train"])
    g = torch.Generator().manual_seed(0)

    configs = {}
    for method in METHODS:
        spec = PeftRunSpec(method=method, lr=1e-3, max_len=args.max_len, batch_size=args.batch)
        configs[method] = _build(spec, total_steps=args.warmup + args.steps * args.repeats)
    if args.update_every > 1:
        from rankwise.peft import adapter_optimizer

        for method in ("dlrt", "sdlrt"):
            model, _, _ = _build(PeftRunSpec(method=method, lr=1e-3), total_steps=1)
            opt = adapter_optimizer(model, 1e-3, optimizer="adam", update_every=args.update_every)
            configs[f"{method}/every-{args.update_every}"] = (model, opt, None)
    counter = {name: 0 for name in configs}

    def steps(name: str, n: int) -> float:
        model, opt, hook = configs[name]
        t0 = time.perf_counter()
        for _ in range(n):
            j = train[torch.randint(len(train), (args.batch,), generator=g)]
            opt.zero_grad()
            loss = F.cross_entropy(model(input_ids=ids[j], attention_mask=mask[j]).logits, y[j])
            loss.backward()
            opt.step()
            if hook is not None:
                hook(counter[name])
            counter[name] += 1
        return (time.perf_counter() - t0) / n

    for name in configs:
        steps(name, args.warmup)
    times: dict[str, list[float]] = {name: [] for name in configs}
    for _ in range(args.repeats):
        for name in configs:
            times[name].append(steps(name, args.steps))

    lora = statistics.median(times["lora"])
    print(f"# PEFT step time, MiniLM-L6, batch {args.batch} x {args.max_len} tokens, "
          f"{args.threads} thread(s), {platform.machine()}, torch {torch.__version__}")
    print(f"# median of {args.repeats} interleaved blocks of {args.steps} steps, "
          f"after {args.warmup} warm-up steps")
    print("| method | ranks (min–max) | s / step | step / LoRA step |")
    print("|---|---|---|---|")
    for name, (model, _, _) in configs.items():
        ranks = list(_ranks_and_params(model, name.split("/")[0])[0].values())
        span = f"{min(ranks)}–{max(ranks)}"
        med = statistics.median(times[name])
        print(f"| {name} | {span} | {med:.3f} | {med / lora:.2f} |")


if __name__ == "__main__":
    main()
