"""FSDP2 over a low-rank LLaMA-style model against dense FSDP2 of the same model: per-rank bytes of
state, collective bytes per step, step time (a GPU kit: CPU-checked tiny, the same command on a
device with ``--device cuda``).

What is measured
    ``rankwise.models.llama`` (``--width``, ``--depth``, ``--context``; byte vocabulary), every
    projection factorised at compression 0.5 (rank (m·n) / (2(m + n))) with fixed capacity
    ``--capacity`` × rank (default 2: ``capacity="auto"``), each block and the root sharded with
    ``fully_shard``; DLRT with the Muon rule (``rule=rankwise.Muon()``, τ = 0.05) against dense AdamW
    under the same sharding, each rank on its own random windows of BBC News. Per world size
    (``--procs``, gloo on CPU; world 1 runs without FSDP2):

    - **state/rank**: the bytes this rank holds of the parameters, their gradients and the
      optimizer state (local shards), after a step; for the low-rank model also of the factors
      alone, against the one-process total / world (the target: ≤ total/world + one padded row per
      factor);
    - **collectives/step**: bytes through torch.distributed collectives in one step, counted by a
      ``TorchDispatchMode`` on the c10d ops (all-gather: the gathered buffer; reduce-scatter: the
      buffer reduced; all-reduce, broadcast: the buffer), split into FSDP2's own and the rest
      (the integrator's gathers of the layers, the loss average);
    - **step**: the median wall time of ``--steps`` steps after 2 warm-up steps, rank 0.

How to run
    .venv/bin/python benchmarks/fsdp_lm.py                       # about 1 min on 2 cores
    .venv/bin/python benchmarks/fsdp_lm.py --procs 1,2,4 --capacity 1.25
"""

from __future__ import annotations

import argparse
import math
import multiprocessing as mp
import os
import statistics
import tempfile
import time
from datetime import timedelta

GATHER = ("allgather", "all_gather")
SCATTER = ("reduce_scatter",)
REDUCE = ("allreduce", "all_reduce", "broadcast")


def _worker(rank: int, world: int, init: str, args: dict, queue) -> None:
    os.environ["OMP_NUM_THREADS"] = "1"
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F
    from torch.utils._python_dispatch import TorchDispatchMode

    import rankwise
    from rankwise.models import llama

    torch.set_num_threads(1)
    if world > 1:
        dist.init_process_group("gloo", init_method=f"file://{init}", rank=rank, world_size=world,
                                timeout=timedelta(seconds=300))
    torch.manual_seed(0)
    model = llama(context=args["context"], width=args["width"], depth=args["depth"], heads=4)
    lowrank = args["kind"] == "lowrank"
    if lowrank:
        ranks = {n: max(1, (m.out_features * m.in_features) // (2 * (m.out_features + m.in_features)))
                 for n, m in model.named_modules() if isinstance(m, torch.nn.Linear) and n != "head"}
        rankwise.to_low_rank(model, rank=ranks)
        for m in model.modules():
            if isinstance(m, rankwise.LowRankLinear):
                m.set_capacity(math.ceil(args["capacity"] * m.rank))
    if world > 1:
        from torch.distributed.fsdp import fully_shard

        for block in model.blocks:
            fully_shard(block)
        fully_shard(model)
    opt = (rankwise.DLRT(model, 3e-3, tau=0.05, rule=rankwise.Muon()) if lowrank
           else torch.optim.AdamW(model.parameters(), lr=3e-3))
    stream = rankwise.data.load_bbc_text().train

    class Bytes(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.n = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            name = str(func)
            collective = any(k in name for k in GATHER + SCATTER + REDUCE)  # (not wait, wrap, ...)
            if name.startswith(("c10d.", "_c10d_functional.")) and collective:
                ts = [a for a in args if isinstance(a, torch.Tensor)]
                ts += [t for a in args if isinstance(a, list) for t in a if isinstance(t, torch.Tensor)]
                most = max((t.numel() * t.element_size() for t in ts), default=0)
                # all-gather: the gathered buffer (a functional one is given its input only)
                self.n += most * (world if "functional" in name and any(k in name for k in GATHER) else 1)
            return func(*args, **(kwargs or {}))

    times, sent = [], (0, 0)
    for step in range(args["steps"] + 2):
        g = torch.Generator().manual_seed(1000 * step + rank)
        x, y = rankwise.data.random_windows(stream, 8, args["context"], g)
        fsdp, step_ = Bytes(), Bytes()
        if world > 1:
            dist.barrier()
        t0 = time.perf_counter()
        with fsdp:  # (FSDP2's all-gathers and reduce-scatters)
            opt.zero_grad()
            F.cross_entropy(model(x).flatten(0, 1), y.flatten()).backward()
        with step_:  # (the optimizer's: the gathered layers)
            opt.step()
        times.append(time.perf_counter() - t0)
        sent = (fsdp.n, step_.n)

    def local(t):
        return 0 if t is None else (t.to_local() if hasattr(t, "to_local") else t).numel() * t.element_size()

    layers = [m for m in model.modules() if isinstance(m, rankwise.LowRankLinear)]
    factors = {id(p) for m in layers for p in (m.U, m.S, m.V)}
    state = {"all": 0, "factors": 0}
    for p in model.parameters():
        b = local(p) + local(p.grad) + sum(local(v) for v in opt.state[p].values() if torch.is_tensor(v))
        state["all"] += b
        if id(p) in factors:
            state["factors"] += b
    pad = sum(4 * p.shape[1] * p.element_size() for m in layers for p in (m.U, m.S, m.V))
    if rank == 0:
        queue.put({"state": state, "pad": pad, "sent": sent, "time": statistics.median(times[2:])})
    if world > 1:
        dist.destroy_process_group()


def run(kind: str, world: int, args: dict) -> dict:
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


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--procs", default="1,2,4")
    ap.add_argument("--width", type=int, default=128)
    ap.add_argument("--depth", type=int, default=2)
    ap.add_argument("--context", type=int, default=64)
    ap.add_argument("--capacity", type=float, default=2.0)
    ap.add_argument("--steps", type=int, default=3)
    a = ap.parse_args()
    args = dict(width=a.width, depth=a.depth, context=a.context, capacity=a.capacity, steps=a.steps)
    procs = [int(n) for n in a.procs.split(",")]
    res = {(k, n): run(k, n, args) for n in procs for k in ("dense", "lowrank")}
    print(f"# FSDP2, llama width {a.width} depth {a.depth} context {a.context}, compression 0.5, capacity "
          f"{a.capacity}×r, gloo, 1 thread/process")
    print("| world | model | state/rank (all) | factors/rank | factors, 1 process / world + padding "
          "| collectives/step: FSDP2 | the optimizer's | all vs dense | step s |")
    print("|---|---|---|---|---|---|---|---|---|")
    for n in procs:
        for k in ("dense", "lowrank"):
            r, one = res[(k, n)], res[(k, procs[0])]
            fac = f"{r['state']['factors']:,}" if k == "lowrank" else ""
            bound = (f"{one['state']['factors'] / n + r['pad']:,.0f}" if k == "lowrank" and n > 1 else "")
            d = sum(res[("dense", n)]["sent"])
            vs = f"{sum(r['sent']) / d:.2f}" if d else ""
            own, opt = r["sent"]
            print(f"| {n} | {k} | {r['state']['all']:,} | {fac} | {bound} | {own:,} | {opt:,} | {vs} "
                  f"| {r['time']:.3f} |")


if __name__ == "__main__":
    main()
