"""Data-parallel low-rank training: step time with 1, 2, 4 processes and the bytes each step
all-reduces, low-rank (``rankwise.SDLRT(..., process_group=)``) against dense (DDP), in one run.

Model: ``--depth`` layers of ``--width``×``--width`` (ReLU between), MSE on random data, a fixed
global batch ``--batch`` split over the processes (strong scaling); low-rank at ``--rank`` with
SDLRT (τ = 0.1, ranks pinned so every configuration does the same work), dense with DDP and
SGD. Processes are spawned with gloo on this machine, one torch thread each; each figure is the
median step time of rank 0 over ``--steps`` steps after 3 warm-up steps. The SDLRT step is split
into forward + backward and the optimizer step (gradient averaging, integrator, replica check),
and timed once more without the replica check.

Bytes: what one rank contributes to the all-reduces of one step, measured (the optimizer's
``allreduce_bytes``; DDP's buckets counted by a communication hook) beside the formulas
(m + n)·r + r² (+ bias m) per low-rank layer and m·n + m per dense layer, 4 bytes each (the
low-rank figure also carries one float64 per gradient: which ranks have it, and a flag).
Usage: ``python benchmarks/dp_scaling.py [--procs 1,2,4]``.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import platform
import statistics
import tempfile
import time
from datetime import timedelta


def _worker(rank: int, world: int, init: str, args: dict, queue) -> None:
    os.environ["OMP_NUM_THREADS"] = "1"
    import torch
    import torch.distributed as dist
    from torch import nn

    import rankwise

    torch.set_num_threads(1)
    if world > 1:
        dist.init_process_group("gloo", init_method=f"file://{init}", rank=rank, world_size=world,
                                timeout=timedelta(seconds=300))
    group = dist.group.WORLD if world > 1 else None
    w, depth, batch, r = args["width"], args["depth"], args["batch"], args["rank"]
    torch.manual_seed(0)
    layers = []
    for i in range(depth):
        layers += [nn.Linear(w, w)] + ([nn.ReLU()] if i < depth - 1 else [])
    model = nn.Sequential(*layers)
    ddp_bytes, reduce_time = [], []
    if args["kind"] in ("lowrank", "lowrank-nocheck"):
        rankwise.to_low_rank(model, rank=r)
        opt = rankwise.SDLRT(model, 1e-3, tau=0.1, min_rank=r, max_rank=r, momentum=0.9, process_group=group)
        if args["kind"] == "lowrank-nocheck":  # what the replica check costs (private: benchmark only)
            opt._check_replicas = lambda: None
        average = opt._average

        def timed_average(*a, **k):  # the gradient all-reduce's share of the step (private: benchmark only)
            t = time.perf_counter()
            out = average(*a, **k)
            reduce_time.append(time.perf_counter() - t)
            return out

        opt._average = timed_average
        net = model
    else:
        opt = torch.optim.SGD(model.parameters(), lr=1e-3, momentum=0.9)
        net = model
        if world > 1:
            net = nn.parallel.DistributedDataParallel(model)

            def counting_hook(state, bucket):
                t = bucket.buffer()
                ddp_bytes.append(t.numel() * t.element_size())
                t.div_(world)
                return dist.all_reduce(t, async_op=True).get_future().then(lambda f: f.value()[0])

            net.register_comm_hook(None, counting_hook)
    g = torch.Generator().manual_seed(1 + rank)
    per = batch // world
    x, y = torch.randn(per, w, generator=g), torch.randn(per, w, generator=g)
    times, sent, fb, red = [], [], [], []
    for step in range(args["steps"] + 3):
        if world > 1:
            dist.barrier()
        reduce_time.clear()
        t0 = time.perf_counter()
        opt.zero_grad()
        nn.functional.mse_loss(net(x), y).backward()
        t1 = time.perf_counter()
        opt.step()
        if world > 1:
            dist.barrier()
        if step >= 3:
            times.append(time.perf_counter() - t0)
            fb.append(t1 - t0)
            red.append(sum(reduce_time))
            if args["kind"] != "dense":
                sent.append(opt.allreduce_bytes)
            else:
                sent.append(sum(ddp_bytes))
        ddp_bytes.clear()
    if rank == 0:
        queue.put((statistics.median(times), statistics.median(sent) if sent else 0, statistics.median(fb),
                   statistics.median(red)))
    if world > 1:
        dist.destroy_process_group()


def run(kind: str, world: int, args: dict) -> tuple[float, float, float, float]:
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    with tempfile.TemporaryDirectory() as tmp:
        init = os.path.join(tmp, "pg")
        procs = [ctx.Process(target=_worker, args=(r, world, init, dict(args, kind=kind), queue))
                 for r in range(world)]
        for p in procs:
            p.start()
        out = queue.get(timeout=900)
        for p in procs:
            p.join(timeout=60)
    return out


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--width", type=int, default=1024)
    p.add_argument("--depth", type=int, default=4)
    p.add_argument("--rank", type=int, default=52, help="rank (52 at width 1024: ~90 %% compression)")
    p.add_argument("--batch", type=int, default=256, help="global batch, split over the processes")
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--procs", default="1,2,4")
    a = p.parse_args(argv)
    procs = [int(n) for n in a.procs.split(",")]
    args = dict(width=a.width, depth=a.depth, rank=a.rank, batch=a.batch, steps=a.steps)
    kinds = ("lowrank", "lowrank-nocheck", "dense")
    res = {(kind, n): run(kind, n, args) for n in procs for kind in kinds
           if kind != "lowrank-nocheck" or n > 1}
    w, r = a.width, a.rank
    print(f"# data-parallel scaling: {a.depth} x {w}x{w}, rank {r}, global batch {a.batch}, gloo, "
          f"1 thread/process, {os.cpu_count()} CPUs, {platform.machine()}")
    print("| processes | SDLRT s/step | vs 1 process | of it: fwd+bwd / optimizer step | of the step: "
          "gradient all-reduce | without the replica check | dense DDP s/step | vs 1 process "
          "| SDLRT / dense |")
    print("|---|---|---|---|---|---|---|---|---|")
    for n in procs:
        lt, _, lfb, lred = res[("lowrank", n)]
        dt = res[("dense", n)][0]
        nc = f"{res[('lowrank-nocheck', n)][0]:.4f}" if ("lowrank-nocheck", n) in res else "–"
        print(f"| {n} | {lt:.4f} | {lt / res[('lowrank', procs[0])][0]:.2f} | {lfb:.4f} / {lt - lfb:.4f} | "
              f"{lred:.4f} | {nc} | {dt:.4f} | {dt / res[('dense', procs[0])][0]:.2f} | {lt / dt:.2f} |")
    multi = [n for n in procs if n > 1]
    if multi:
        n = multi[0]
        lr_formula = 4 * a.depth * ((w + w) * r + r * r + w)
        dense_formula = 4 * a.depth * (w * w + w)
        lb, db = res[("lowrank", n)][1], res[("dense", n)][1]
        print(f"\n# bytes all-reduced per step and rank ({n} processes)")
        print("| | measured | formula | measured / dense |")
        print("|---|---|---|---|")
        print(f"| SDLRT ((m + n)·r + r² + m per layer) | {lb:,.0f} | {lr_formula:,} | {lb / db:.3f} |")
        print(f"| dense DDP (m·n + m per layer) | {db:,.0f} | {dense_formula:,} | 1.000 |")


if __name__ == "__main__":
    main()
