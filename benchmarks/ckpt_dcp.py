"""Coded DCP storage vs DCP's own file-system storage, on sharded state, in one run.

Run: ``.venv/bin/python benchmarks/ckpt_dcp.py`` (4 gloo processes; 64 and 256 MiB in all by
default). Each rank holds its own shard of the state (as under FSDP2: 1/n of every tensor, its own
keys), plus a replicated step counter. Per size, in one group of processes, each timed between
barriers, slowest rank, the median of `--repeat` runs after one warm-up (training saves again and
again: files and buffers exist):

- ``save``: ``dcp.save`` with ``FileSystemWriter`` (one folder every rank writes into) and with
  :class:`rankwise.ckpt.CodedStorageWriter` (each rank its own folder ``rank{i}``; t = 1).
- ``async``: how long ``dcp.async_save`` with the coded writer blocks training, against a plain
  copy of the state to host memory (``clone`` of every tensor); and the whole background save.
- ``load``: ``dcp.load`` with ``FileSystemReader`` and with :class:`CodedStorageReader` (with its
  scrub, the default, and with ``scrub=False``: only the row blocks asked for are read); then rank
  2's folder is wiped (a replaced machine) and the coded load rebuilds it: the bytes rank 2
  received for its repair against the formula 2|m|/k (k helpers' two blocks of |m|/k²).
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
VICTIM = 2


def _state(rank: int, n: int, mib: int) -> dict:
    import torch

    g = torch.Generator().manual_seed(rank)
    per = mib * 2**20 // 4 // 8 // n  # 8 tensors, this rank's 1/n of each
    return {"model": {f"w{i}.shard{rank}": torch.randn(per, generator=g) for i in range(8)}, "step": 7}


def _timed(fn, repeat: int) -> float:
    """Median over `repeat` runs (after one warm-up) of the slowest rank's seconds."""
    import torch
    import torch.distributed as dist

    fn()
    times = []
    for _ in range(repeat):
        dist.barrier()
        t0 = time.perf_counter()
        fn()
        dt = torch.tensor([time.perf_counter() - t0], dtype=torch.float64)
        dist.all_reduce(dt, op=dist.ReduceOp.MAX)
        times.append(float(dt))
    return statistics.median(times)


def _bench(rank: int, root: str, sizes: list[int], repeat: int) -> dict:
    import warnings

    import torch.distributed as dist

    warnings.filterwarnings("ignore")
    out = {}
    for mib in sizes:
        base = Path(root) / f"{mib}"
        out[mib] = _one(rank, dist.get_world_size(), base, mib, repeat)
        dist.barrier()
        if rank == 0:
            shutil.rmtree(base)
    return out


def _one(rank: int, n: int, base: Path, mib: int, repeat: int) -> dict:
    import torch
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp

    from rankwise.ckpt import CodedStorageReader, CodedStorageWriter, _layout, _store

    sd = _state(rank, n, mib)
    plain, coded = base / "plain", base / "coded"

    def zeros() -> dict:
        return {"model": {k: torch.zeros_like(v) for k, v in sd["model"].items()}, "step": 0}

    r = {"save_plain": _timed(lambda: dcp.save(sd, storage_writer=dcp.FileSystemWriter(plain)), repeat)}
    writers: list = []

    def save_coded() -> None:
        writers.append(CodedStorageWriter(coded, t=1))
        dcp.save(sd, storage_writer=writers[-1])

    r["save_coded"] = _timed(save_coded, repeat)
    r["save_parts"] = {k: v for k, v in writers[-1].stats.items() if k.endswith("_s")}
    r["copy"] = _timed(lambda: {k: v.clone() for k, v in sd["model"].items()}, repeat)
    blocked, total = [], []
    for _ in range(repeat + 1):
        dist.barrier()
        t0 = time.perf_counter()
        fut = dcp.async_save(sd, storage_writer=CodedStorageWriter(base / "bg", t=1))
        t1 = time.perf_counter()
        fut.result()
        t2 = time.perf_counter()
        dt = torch.tensor([t1 - t0, t2 - t0], dtype=torch.float64)
        dist.all_reduce(dt, op=dist.ReduceOp.MAX)
        blocked.append(float(dt[0]))
        total.append(float(dt[1]))
    r["async_blocked"], r["async_total"] = statistics.median(blocked[1:]), statistics.median(total[1:])

    def load_plain() -> None:
        dcp.load(zeros(), storage_reader=dcp.FileSystemReader(plain))

    stats: list[dict] = []

    def load_coded() -> None:
        got, reader = zeros(), CodedStorageReader(coded)
        dcp.load(got, storage_reader=reader)
        assert all(torch.equal(got["model"][k], sd["model"][k]) for k in sd["model"]), "wrong state"
        stats.append(reader.stats)

    def wipe_and_load() -> None:
        dist.barrier()
        if rank == VICTIM:
            shutil.rmtree(coded / f"rank{VICTIM}")
        dist.barrier()
        load_coded()

    r["load_plain"] = _timed(load_plain, repeat)
    r["load_coded"] = _timed(load_coded, repeat)

    def load_lazy() -> None:
        got = zeros()
        dcp.load(got, storage_reader=CodedStorageReader(coded, scrub=False))
        assert all(torch.equal(got["model"][k], sd["model"][k]) for k in sd["model"]), "wrong state"

    r["load_lazy"] = _timed(load_lazy, repeat)
    r["load_parts"] = {k: v for k, v in stats[-1].items() if k.endswith("_s")}
    r["load_repair"] = _timed(wipe_and_load, repeat)
    st = stats[-1]
    r["repaired"] = st["repaired"]
    r["repair_received"] = st["received"].get("repair", 0)
    r["retrieve_received"] = st["received"].get("retrieve", 0)
    com = _layout.commitment_of(_store.read_metadata(coded / f"rank{rank}" / _layout.META))
    r["data_len"], r["k"], r["block"] = com.data_len, com.n - com.t, com.block_size
    return r


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--nproc", type=int, default=4)
    ap.add_argument("--sizes", default="64,256", help="state sizes in MiB (all ranks together)")
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--json", default=None, help="also write the results here")
    a = ap.parse_args()
    from distributed import run_world

    sizes = [int(s) for s in a.sizes.split(",")]
    with tempfile.TemporaryDirectory() as tmp:
        res = run_world(_bench, a.nproc, Path(tmp), tmp, sizes, a.repeat, timeout=3600, pg_timeout=600)
    print(f"{a.nproc} processes, t = 1; seconds: the slowest rank, median of {a.repeat} after a warm-up\n")
    print("| MiB | DCP save | coded save | ratio | copy to host | async_save blocks | ratio | background "
          "save | DCP load | coded load | ratio | coded load, scrub=False | ratio | coded load, rank 2 wiped "
          "| repair bytes (rank 2) / 2|m|/k |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for mib in sizes:
        r = res[0][mib]
        v = res[VICTIM][mib]
        formula = 2 * v["data_len"] / v["k"]
        print(f"| {mib} | {r['save_plain']:.3f} | {r['save_coded']:.3f} "
              f"| {r['save_coded'] / r['save_plain']:.2f} "
              f"| {r['copy']:.3f} | {r['async_blocked']:.3f} | {r['async_blocked'] / r['copy']:.2f} "
              f"| {r['async_total']:.3f} | {r['load_plain']:.3f} | {r['load_coded']:.3f} "
              f"| {r['load_coded'] / r['load_plain']:.2f} | {r['load_lazy']:.3f} "
              f"| {r['load_lazy'] / r['load_plain']:.2f} | {r['load_repair']:.3f} "
              f"| {v['repair_received']:,} / {formula:,.0f} = {v['repair_received'] / formula:.4f} |")
    print("\nwhere a rank's time goes (the slowest rank per part, the last timed run; seconds)\n")
    print("| MiB | save: serialise | encode (exchange, extend, hash) | write (fsync) "
          "| load: read own fragment | check its 2k blocks and repair | fetch + verify blocks "
          "| whole read_data |")
    print("|---|---|---|---|---|---|---|---|")
    for mib in sizes:
        sp = {k: max(res[r][mib]["save_parts"][k] for r in range(a.nproc)) for k in res[0][mib]["save_parts"]}
        lp = {k: max(res[r][mib]["load_parts"].get(k, 0.0) for r in range(a.nproc))
              for k in ("check_s", "repair_s", "retrieve_s", "read_s")}
        print(f"| {mib} | {sp['serialise_s']:.3f} | {sp['encode_s']:.3f} | {sp['write_s']:.3f} "
              f"| {lp['check_s']:.3f} | {lp['repair_s']:.3f} | {lp['retrieve_s']:.3f} | {lp['read_s']:.3f} |")
    if a.json:
        Path(a.json).write_text(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
