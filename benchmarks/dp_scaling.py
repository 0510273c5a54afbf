"""Data-parallel low-rank training: step time with 1, 2, 4 processes and the bytes each step
moves, low-rank SDLRT with the replicated and the sharded integrator, SDLRT on a DDP-wrapped model
with fixed-capacity factors, against dense DDP, in one run.

Model: ``--depth`` layers of ``--width``×``--width`` (ReLU between), MSE on random data, a fixed
global batch ``--batch`` split over the processes (strong scaling); low-rank at ``--rank`` with
SDLRT (τ = 0.1, ranks pinned so every configuration does the same work), dense with DDP and
SGD. Processes are spawned with gloo on this machine, one torch thread each; each figure is the
median of rank 0 over ``--steps`` steps after 3 warm-up steps.

- ``replicated`` (``data_parallel="replicated"``): gradients averaged by all-reduce, every rank
  integrates every layer, the replicas' hashes compared after every truncation.
- ``sharded`` (``data_parallel="sharded"``, ``check_every=0``): each layer's gradients reduced
  to its owner (the biases' all-reduced), each layer integrated by its owner, which then
  broadcasts the new factors, buffers and optimizer state; no replica hash (the factors are
  copies; the dense parameters here are biases only).

- ``ddp``: ``to_low_rank(..., capacity=--capacity)`` (default twice the rank), the model wrapped in
  ``DistributedDataParallel(broadcast_buffers=False)``, SDLRT built on the wrapper: the gradients
  of U, S, V (at the capacity) and the biases are averaged by DDP's buckets during the backward,
  every rank integrates every layer.

The step is split into forward + backward, the gradient all-reduce, the owners' broadcast
(sharded) and the rest (the integrator, the replica check, bookkeeping). Bytes: what rank 0
sent in one step, measured (the optimizer's ``allreduce_bytes`` and ``shared_bytes``; DDP's
buckets counted by a communication hook) beside the formulas, 4 bytes a number: all-reduce
(m + n)·r + r² + m per low-rank layer (plus one float64 per gradient: which ranks have it, and
a flag), m·n + m per dense layer; sharded, the factor gradients (m + n)·r + r² of each layer go
to its owner only (a rank sends those of the layers it does not own); the owners' broadcast
3(m + n)·r + 2r² per layer the rank owns (U, V, the buffers U_buf, V_buf at width r, S; the
momenta of K, L, S).
``--phases`` also splits rank 0's low-rank step into phases (step_time.py's, plus the gradient
exchange, the owners' broadcast, the agreement on a bad update, the replica check).
Usage: ``python benchmarks/dp_scaling.py [--procs 1,2,4] [--phases]``.
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

KINDS = ("replicated", "sharded", "ddp", "dense")


def _timed(fn, into: list):
    """`fn`, adding its wall time to the list `into` (benchmark instrumentation only)."""
    def wrapper(*a, **k):
        t = time.perf_counter()
        out = fn(*a, **k)
        into.append(time.perf_counter() - t)
        return out
    return wrapper


def _worker(rank: int, world: int, init: str, args: dict, queue) -> None:
    os.environ["OMP_NUM_THREADS"] = "1"
    import torch
    import torch.distributed as dist
    from torch import nn

    import rankwise
    from rankwise.optim import _optim

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
    ddp_bytes, reduce_time, share_time = [], [], []
    kind = args["kind"]
    hook_net = None
    if kind == "ddp":  # fixed-capacity factors under DDP: U's, S's, V's gradients in DDP's buckets
        rankwise.to_low_rank(model, rank=r, capacity=args["capacity"])
        net = model
        if world > 1:
            net = hook_net = nn.parallel.DistributedDataParallel(model, broadcast_buffers=False)
        opt = rankwise.SDLRT(net, 1e-3, tau=0.1, min_rank=r, max_rank=r, momentum=0.9)
    elif kind != "dense":
        rankwise.to_low_rank(model, rank=r)
        extra = dict(data_parallel="sharded", check_every=0) if kind == "sharded" else \
            dict(data_parallel="replicated")
        opt = rankwise.SDLRT(model, 1e-3, tau=0.1, min_rank=r, max_rank=r, momentum=0.9, process_group=group,
                             **extra)
        if opt.dp is not None:  # (one process: no exchange)
            opt.dp.average = _timed(opt.dp.average, reduce_time)  # (private: benchmark only)
        _optim._shard.share_from_owners = _timed(_optim._shard.share_from_owners, share_time)
        net = model
    else:
        opt = torch.optim.SGD(model.parameters(), lr=1e-3, momentum=0.9)
        net = model
        if world > 1:
            net = hook_net = nn.parallel.DistributedDataParallel(model)
    if hook_net is not None and world > 1:

        def counting_hook(state, bucket):
            t = bucket.buffer()
            ddp_bytes.append(t.numel() * t.element_size())
            t.div_(world)
            return dist.all_reduce(t, async_op=True).get_future().then(lambda f: f.value()[0])

        hook_net.register_comm_hook(None, counting_hook)
    g = torch.Generator().manual_seed(1 + rank)
    per = batch // world
    x, y = torch.randn(per, w, generator=g), torch.randn(per, w, generator=g)
    rows = []
    phases = None
    if args["phases"] and kind not in ("dense", "ddp"):  # the optimizer step split into phases
        from step_time import PHASES, _Phases

        phases = _Phases({**PHASES, "owners' broadcast": [("shard", "share_from_owners")],
                          "agreement": [("replicas", "decide")], "replica check": [("replicas", "check")]})
    for step in range(args["steps"] + 3):
        if phases is not None and step == 3:
            phases.__enter__()
        if world > 1:
            dist.barrier()
        reduce_time.clear()
        share_time.clear()
        t0 = time.perf_counter()
        opt.zero_grad()
        nn.functional.mse_loss(net(x), y).backward()
        t1 = time.perf_counter()
        opt.step()
        t2 = time.perf_counter()
        if world > 1:
            dist.barrier()
        if step >= 3:
            ours = (opt.allreduce_bytes, opt.shared_bytes) if kind not in ("dense", "ddp") else None
            sent = (sum(ddp_bytes), 0) if ours is None else ours
            rows.append((t2 - t0, t1 - t0, sum(reduce_time), sum(share_time), *sent))
        ddp_bytes.clear()
    split = {}
    if phases is not None:
        phases.__exit__()
        split = {k: v / args["steps"] for k, v in phases.total.items()}
    if rank == 0:
        queue.put((*(statistics.median(col) for col in zip(*rows, strict=True)), split))
    if world > 1:
        dist.destroy_process_group()


def run(kind: str, world: int, args: dict) -> tuple[float, ...]:
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
    p.add_argument("--capacity", type=int, default=None,
                   help="the ddp rows' fixed capacity (default 2·rank)")
    p.add_argument("--phases", action="store_true",
                   help="also split rank 0's low-rank step into phases (mean ms/step; slower)")
    a = p.parse_args(argv)
    procs = [int(n) for n in a.procs.split(",")]
    capacity = a.capacity or 2 * a.rank
    args = dict(width=a.width, depth=a.depth, rank=a.rank, batch=a.batch, steps=a.steps, phases=a.phases,
                capacity=capacity)
    res = {(kind, n): run(kind, n, args) for n in procs for kind in KINDS if kind != "sharded" or n > 1}
    if 1 in procs:  # one process: nothing to shard
        res[("sharded", 1)] = res[("replicated", 1)]
    w, r = a.width, a.rank
    one = procs[0]
    print(f"# data-parallel scaling: {a.depth} x {w}x{w}, rank {r}, global batch {a.batch}, gloo, "
          f"1 thread/process, {os.cpu_count()} CPUs, {platform.machine()}")
    print("| processes | integrator | s/step | vs 1 process | fwd+bwd | gradient all-reduce "
          "| owners' broadcast | rest (integrator, checks) | communication / step | vs dense DDP |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for n in procs:
        dt = res[("dense", n)][0]
        for kind in ("replicated", "sharded"):
            if kind == "sharded" and n == 1:
                continue
            step, fb, red, share, _, _, _ = res[(kind, n)]
            print(f"| {n} | {kind} | {step:.4f} | {step / res[(kind, one)][0]:.2f} | {fb:.4f} | {red:.4f} | "
                  f"{share:.4f} | {step - fb - red - share:.4f} | {(red + share) / step:.0%} "
                  f"| {step / dt:.2f} |")
        step, fb = res[("ddp", n)][:2]
        print(f"| {n} | DDP, capacity {capacity} | {step:.4f} | {step / res[('ddp', one)][0]:.2f} | {fb:.4f} "
              f"(all-reduce overlapped) | | | {step - fb:.4f} | | {step / dt:.2f} |")
        print(f"| {n} | dense DDP | {dt:.4f} | {dt / res[('dense', one)][0]:.2f} | | | | | | 1.00 |")
    if a.phases:
        names = [k for k in next(v[6] for v in res.values() if v[6])  # (fwd+bwd, the all-reduce: above)
                 if any(v[6].get(k, 0) > 5e-5 for v in res.values() if v[6])]
        print("\n# rank 0's low-rank step by phase, ms (mean over the steps; exclusive wall time, "
              "waiting for the other ranks included in the collectives)")
        print("| processes | integrator | " + " | ".join(names) + " |")
        print("|---|---|" + "---|" * len(names))
        for n in procs:
            for kind in ("replicated", "sharded"):
                if kind == "sharded" and n == 1:
                    continue
                split = res[(kind, n)][6]
                print(f"| {n} | {kind} | " + " | ".join(f"{1e3 * split[k]:.1f}" for k in names) + " |")
    multi = [n for n in procs if n > 1]
    if multi:
        n = multi[0]
        lr_formula = 4 * a.depth * ((w + w) * r + r * r + w)
        dense_formula = 4 * a.depth * (w * w + w)
        owned = -(-a.depth // n)  # rank 0 owns the most layers: ceil(depth / n) of equal cost
        share_formula = 4 * owned * (3 * (w + w) * r + 2 * r * r)
        lb, db = res[("replicated", n)][4], res[("dense", n)][4]
        gb, sb = res[("sharded", n)][4], res[("sharded", n)][5]
        reduce_formula = 4 * ((a.depth - owned) * ((w + w) * r + r * r) + a.depth * w)
        print(f"\n# bytes rank 0 sent per step ({n} processes)")
        print("| | measured | formula | measured / formula |")
        print("|---|---|---|---|")
        print(f"| SDLRT gradient all-reduce ((m + n)·r + r² + m per layer) | {lb:,.0f} | {lr_formula:,} | "
              f"{lb / lr_formula:.3f} |")
        print(f"| sharded: gradients reduced to their owners ((m + n)·r + r² per layer of another rank, "
              f"m per layer) | {gb:,.0f} | {reduce_formula:,} | {gb / reduce_formula:.3f} |")
        print(f"| sharded: owners' broadcast (3(m + n)·r + 2r² per owned layer) | {sb:,.0f} "
              f"| {share_formula:,} | {sb / share_formula:.3f} |")
        cb, R = res[("ddp", n)][4], capacity
        ddp_formula = 4 * a.depth * ((w + w) * R + R * R + w)
        print(f"| SDLRT under DDP at capacity R = {R} ((m + n)·R + R² + m per layer) | {cb:,.0f} | "
              f"{ddp_formula:,} | {cb / ddp_formula:.3f} |")
        print(f"| dense DDP (m·n + m per layer) | {db:,.0f} | {dense_formula:,} | {db / dense_formula:.3f} |")


if __name__ == "__main__":
    main()
