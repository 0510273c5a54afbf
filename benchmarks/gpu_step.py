"""One training step of DLRT / SDLRT against dense and fixed-rank AdamW, on the GPU (or the CPU).

What is measured
    Median wall-clock time of one full step (``opt.step(closure)``: zero_grad, forward, backward,
    update; ``torch.cuda.synchronize()`` before the clock stops) for, side by side in one run:

    - ``dense AdamW``: the model with ``nn.Linear`` layers and ``torch.optim.AdamW``;
    - ``fixed AdamW``: every converted layer as two ``nn.Linear`` factors at rank r, AdamW;
    - ``DLRT SGD``, ``DLRT Adam``, ``SDLRT SGD``, ``SDLRT Adam``: the converted layers at rank r
      (``max_rank=r``, ``tau=1e-3``; SGD with momentum 0.9), every step augmenting;
    - ``DLRT Adam ueK``: ``update_every=K`` (default 10), the mean over whole periods.

    Models: MLPs of 4 width→width layers (ReLU, MSE against a fixed target) and
    ``rankwise.models.gpt`` (its 6 projections per block converted, cross-entropy on random
    bytes). On CUDA: MLP 2048 (batch 256, r 102), 4096 (4096, 204), 8192 (8192, 409), GPT
    width 256 (r 64) and 1024 (r 256), 32 × 128 tokens, fp32 -- issue 39's table. On the CPU
    (or with ``--small``) smaller sizes, so that it finishes in minutes on 2 cores.

    Per step it also counts, for one step after warm-up: on CUDA the device→host
    synchronisations (``torch.cuda.set_sync_debug_mode("warn")``, one warning each) and the
    kernels launched (``torch.profiler``, CUDA kernel events); everywhere the dispatched aten
    ops and host reads (``rankwise._opcount.OpCounter``: ``.item()``, ``nonzero``, ``tolist``...).

How to run
    PYTHONPATH=src python benchmarks/gpu_step.py            # CUDA if present; < 5 min on one H200
    .venv/bin/python benchmarks/gpu_step.py --small         # CPU sizes (about 3 min on 2 cores)
    .venv/bin/python benchmarks/gpu_step.py --only mlp      # only rows whose model name has 'mlp'
    .venv/bin/python benchmarks/gpu_step.py --implementation exact  # groups of one rank
"""

from __future__ import annotations

import argparse
import platform
import statistics
import sys
import time
import warnings

import torch
from torch import nn

import rankwise
from rankwise._opcount import OpCounter
from rankwise.models import gpt

METHODS = ("dense AdamW", "fixed AdamW", "DLRT SGD", "DLRT Adam", "SDLRT SGD", "SDLRT Adam")


def _mlp(width: int, device) -> nn.Module:
    layers: list[nn.Module] = []
    for i in range(4):
        layers += [nn.Linear(width, width)] + ([nn.ReLU()] if i < 3 else [])
    return nn.Sequential(*layers).to(device)


def _factorise(model: nn.Module, rank: int, names: list[str]) -> nn.Module:
    """Each named nn.Linear as two nn.Linear factors at `rank` (the plain factorisation)."""
    for name in names:
        parent, _, leaf = name.rpartition(".")
        owner = model.get_submodule(parent) if parent else model
        lin = getattr(owner, leaf)
        r = min(rank, lin.in_features, lin.out_features)
        pair = nn.Sequential(nn.Linear(lin.in_features, r, bias=False),
                             nn.Linear(r, lin.out_features, bias=lin.bias is not None))
        setattr(owner, leaf, pair.to(lin.weight.device))
    return model


def _problem(kind: str, width: int, batch: int, device):
    """(model factory, the linear layers to convert, a loss function of the model)."""
    g = torch.Generator(device="cpu").manual_seed(0)
    if kind == "mlp":
        X = torch.randn(batch, width, generator=g).to(device)
        Y = torch.randn(batch, width, generator=g).to(device)

        def loss_fn(model):
            return ((model(X) - Y) ** 2).mean()

        return (lambda: _mlp(width, device)), [str(i) for i in (0, 2, 4, 6)], loss_fn
    tokens, context = batch
    x = torch.randint(0, 256, (tokens, context + 1), generator=g).to(device)

    def loss_fn(model):
        out = model(x[:, :-1])
        return nn.functional.cross_entropy(out.reshape(-1, out.shape[-1]), x[:, 1:].reshape(-1))

    def make():
        return gpt(width=width, depth=4, context=context).to(device)

    names = [n for n, m in make().named_modules()
             if isinstance(m, nn.Linear) and (".attn." in n or n.endswith((".fc", ".proj")))]
    return make, names, loss_fn


def _build(method: str, make, names, rank: int, lr: float, update_every: int):
    torch.manual_seed(0)
    model = make()
    if method == "dense AdamW":
        return model, torch.optim.AdamW(model.parameters(), lr)
    if method == "fixed AdamW":
        _factorise(model, rank, names)
        return model, torch.optim.AdamW(model.parameters(), lr)
    rankwise.to_low_rank(model, rank=rank, max_rank=rank, include=names)
    cls = rankwise.DLRT if method.startswith("DLRT") else rankwise.SDLRT
    rule = dict(optimizer="adam") if "Adam" in method else dict(momentum=0.9)
    return model, cls(model, lr, tau=1e-3, update_every=update_every, **rule)


def _closure(model, opt, loss_fn):
    def closure():
        opt.zero_grad()
        loss = loss_fn(model)
        loss.backward()
        return loss
    return closure


def _sync(device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def _time(step, device, steps: int) -> float:
    times = []
    for _ in range(steps):
        _sync(device)
        t = time.perf_counter()
        step()
        _sync(device)
        times.append(time.perf_counter() - t)
    return statistics.median(times) * 1e3


def _counts(step, device) -> dict:
    out = {}
    with OpCounter() as c:
        step()
    out["ops"], out["reads"] = c.ops, c.host_reads
    if device.type == "cuda":
        _sync(device)
        with warnings.catch_warnings(record=True) as w:
            warnings.simplefilter("always")
            torch.cuda.set_sync_debug_mode("warn")
            try:
                step()
            finally:
                torch.cuda.set_sync_debug_mode("default")
        out["syncs"] = sum("synchroniz" in str(x.message) for x in w)
        from torch.profiler import ProfilerActivity, profile

        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            step()
            _sync(device)
        out["kernels"] = sum(1 for e in prof.events() if e.device_type.name == "CUDA")
    return out


def run(configs, device, steps: int, warmup: int, update_every: int, lr: float = 1e-3) -> list[dict]:
    rows = []
    for kind, label, width, batch, rank in configs:
        make, names, loss_fn = _problem(kind, width, batch, device)
        dense_ms = None
        methods = [*METHODS, f"DLRT Adam ue{update_every}"]
        for method in methods:
            every = update_every if "ue" in method else 1
            model, opt = _build(method.split(" ue")[0], make, names, rank, lr, every)
            closure = _closure(model, opt, loss_fn)

            def step(opt=opt, closure=closure):
                opt.step(closure)

            for _ in range(warmup):
                step()
            n = steps if every == 1 else max(steps // every, 1) * every
            if every > 1:  # whole periods: the mean over one augmentation and every-1 core steps
                _sync(device)
                t = time.perf_counter()
                for _ in range(n):
                    step()
                _sync(device)
                ms = (time.perf_counter() - t) / n * 1e3
            else:
                ms = _time(step, device, n)
            counts = _counts(step, device) if every == 1 else {}
            if method == "dense AdamW":
                dense_ms = ms
            rows.append(dict(model=label, method=method, ms=ms, x_dense=ms / dense_ms, **counts))
            print(f"  {label:>22} {method:<16} {ms:9.2f} ms  {ms / dense_ms:6.2f}x dense  {counts}",
                  file=sys.stderr, flush=True)
            del model, opt
            if device.type == "cuda":
                torch.cuda.empty_cache()
    return rows


def table(rows: list[dict], device) -> str:
    cuda = device.type == "cuda"
    head = ["model", "method", "ms/step", "×dense", "host reads", "aten ops"] + (
        ["syncs", "kernels"] if cuda else [])
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        vals = [r["model"], r["method"], f"{r['ms']:.2f}", f"{r['x_dense']:.2f}",
                str(r.get("reads", "")), str(r.get("ops", ""))]
        if cuda:
            vals += [str(r.get("syncs", "")), str(r.get("kernels", ""))]
        lines.append("| " + " | ".join(vals) + " |")
    return "\n".join(lines)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--small", action="store_true", help="the CPU sizes even on CUDA")
    p.add_argument("--steps", type=int, default=None, help="timed steps per row (median)")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--update-every", type=int, default=10)
    p.add_argument("--only", default=None, help="only models whose name contains this")
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--implementation", choices=("batched", "exact"), default="batched",
                   help="the optimizer's implementation (exact: groups of one rank)")
    a = p.parse_args(argv)
    if a.implementation != "batched":
        import functools

        from rankwise.optim._optim import AugmentedBUG

        init = AugmentedBUG.__init__
        AugmentedBUG.__init__ = functools.partialmethod(init, implementation=a.implementation)
    if a.threads:
        torch.set_num_threads(a.threads)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    big = device.type == "cuda" and not a.small
    if big:
        configs = [("mlp", "MLP 4×2048, b256", 2048, 256, 102),
                   ("mlp", "MLP 4×4096, b4096", 4096, 4096, 204),
                   ("mlp", "MLP 4×8192, b8192", 8192, 8192, 409),
                   ("gpt", "gpt(256), 32×128", 256, (32, 128), 64),
                   ("gpt", "gpt(1024), 32×128", 1024, (32, 128), 256)]
        steps = a.steps or 20
    else:
        configs = [("mlp", "MLP 4×512, b128", 512, 128, 25),
                   ("mlp", "MLP 4×2048, b256", 2048, 256, 102),
                   ("gpt", "gpt(128), 8×64", 128, (8, 64), 32)]
        steps = a.steps or 5
    if a.only:
        configs = [c for c in configs if a.only in c[1].lower()]
    cpu = platform.processor() or platform.machine()
    name = torch.cuda.get_device_name() if device.type == "cuda" else cpu
    print(f"device: {device} ({name}), torch {torch.__version__}, threads {torch.get_num_threads()}, "
          f"fp32, median of {steps} steps after {a.warmup} warm-up, "
          f"implementation {a.implementation}")
    rows = run(configs, device, steps, a.warmup, a.update_every)
    print(table(rows, device))


if __name__ == "__main__":
    main()
