"""Coded checkpoints vs replication, a central store and DCP, over gloo, in one run.

Run: ``.venv/bin/python benchmarks/ckpt_dist.py`` (4 processes; sizes 16 and 256 MiB; about
3 min on 2 cores). Scenario per method: every rank saves the same state (DDP) twice, the second
save timed (training saves again and again: its buffers and files already exist); rank 2's node
is then lost (its local store wiped) and the job restarts: for each method a fresh group of
processes (as after a real restart, so that no method finds memory another one freed)
rebuilds rank 2's share and loads the state on every rank. Times are the slowest rank's; bytes
are counted from what is sent.

- ``coded``: :class:`rankwise.ckpt.CodedCheckpointer`, t = 1 (k = n − 1).
- ``replicate``: every node keeps a full ``torch.save`` copy; the lost node copies it back from
  a peer over the process group. ``replicate, fsync``: the same save made durable (fsync), as
  the coded files are; its rebuild and load are replicate's.
- ``central``: rank 0 ``torch.save`` s to one shared folder; every rank reads it back.
- ``dcp``: ``torch.distributed.checkpoint`` with the file-system writer to one shared folder;
  every rank loads. (Central and DCP keep nothing on the nodes, so there is nothing to rebuild,
  but they depend on the shared store surviving.)
"""

from __future__ import annotations

import argparse
import io
import json
import multiprocessing as mp
import os
import shutil
import tempfile
import time
from datetime import timedelta
from pathlib import Path

PHASES = ("check", "repair", "write", "retrieve", "load")  # CodedCheckpointer.stats() after restore


def _state(mib: int) -> dict:
    import torch

    g = torch.Generator().manual_seed(0)
    n = mib * 2**20 // 4 // 8
    return {"model": {f"w{i}": torch.randn(n, generator=g) for i in range(8)}, "step": 7}


METHODS = ("coded", "replicate", "central", "dcp")
VICTIM = 2  # the rank whose node is lost


def _timed(fn, warm: bool = False):
    """(result, seconds) of `fn` between barriers; `warm`: call it once before (a save's steady
    state: training saves again and again, so its buffers and files exist)."""
    import torch.distributed as dist

    if warm:
        fn()
    dist.barrier()
    t0 = time.perf_counter()
    r = fn()
    dt = time.perf_counter() - t0
    dist.barrier()
    return r, dt


def _dir_bytes(p: Path) -> int:
    return sum(f.stat().st_size for f in p.rglob("*") if f.is_file()) if p.exists() else 0


def _save_all(rank: int, root: str, mib: int) -> dict:
    """Every method saves the same state (twice, the second timed); then rank VICTIM's node-local
    stores are wiped."""
    import torch
    import torch.distributed.checkpoint as dcp

    from rankwise.ckpt import CodedCheckpointer
    from rankwise.ckpt._serial import _to_cpu
    from rankwise.ckpt._store import step_dir

    out: dict = {}
    state = _state(mib)
    root_p = Path(root)

    ck = CodedCheckpointer(t=1, store_dir=root_p / "coded")
    _, t_save = _timed(lambda: ck.save(state, 7), warm=True)  # (the warm-up saves step 7 too)
    out["coded"] = dict(save=t_save, stored=_dir_bytes(step_dir(root_p / "coded", rank, 7)))

    # coded, in the background: what training waits for, against copying the state in host memory
    _, t_copy = _timed(lambda: _to_cpu(state, copy=True), warm=True)  # as the async snapshot: warm
    ck_async = CodedCheckpointer(t=1, store_dir=root_p / "coded_async")
    ck_async.save(state, 6, blocking=False).result()  # (the first also creates its process group)
    fut, t_blocked = _timed(lambda: ck_async.save(state, 7, blocking=False))
    t0 = time.perf_counter()
    fut.result()
    out["async"] = dict(copy=t_copy, blocked=t_blocked, total=t_blocked + time.perf_counter() - t0)
    ck_async.close()

    mine = root_p / "replicate" / f"rank{rank}"
    mine.mkdir(parents=True, exist_ok=True)
    _, t_save = _timed(lambda: torch.save(state, mine / "state.pt"), warm=True)

    def save_rep_fsync():  # the same, made durable as the coded save's files are
        with open(mine / "state_fsync.pt", "wb") as f:
            torch.save(state, f)
            f.flush()
            os.fsync(f.fileno())

    _, t_save_fsync = _timed(save_rep_fsync, warm=True)
    (mine / "state_fsync.pt").unlink()
    out["replicate"] = dict(save=t_save, stored=_dir_bytes(mine))
    out["replicate, fsync"] = dict(out["replicate"], save=t_save_fsync)

    shared = root_p / "central"
    shared.mkdir(parents=True, exist_ok=True)
    _, t_save = _timed(lambda: torch.save(state, shared / "state.pt") if rank == 0 else None, warm=True)
    out["central"] = dict(save=t_save, stored=(shared / "state.pt").stat().st_size if rank == 0 else 0)

    dshared = root_p / "dcp"
    _, t_save = _timed(lambda: dcp.save(state, storage_writer=dcp.FileSystemWriter(str(dshared))), warm=True)
    out["dcp"] = dict(save=t_save, stored=_dir_bytes(dshared) if rank == 0 else 0)
    out["state_bytes"] = len(_save_bytes(state))
    if rank == VICTIM:  # the lost node: its local stores are gone
        shutil.rmtree(root_p / "coded" / f"rank{rank}")
        shutil.rmtree(mine)
    return out


def _save_bytes(state) -> bytes:
    import torch

    buf = io.BytesIO()
    torch.save(state, buf)
    return buf.getvalue()


def _restore(rank: int, root: str, mib: int, method: str) -> dict:
    """In a fresh process group (the job restarted): rebuild the lost node's copy, then load
    the state on every rank."""
    import torch
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp

    from rankwise.ckpt import CodedCheckpointer

    root_p = Path(root)
    if method == "coded":
        ck = CodedCheckpointer(t=1, store_dir=root_p / "coded")
        _, t_restore = _timed(ck.restore)
        st = ck.stats()
        return dict(rebuild_bytes=st["repair_bytes_received"], rebuild_s=st["repair_seconds"],
                    load_bytes=st["retrieve_bytes_received"], load_s=t_restore,
                    phases={k: st[f"{k}_seconds"] for k in PHASES})
    if method == "replicate":
        mine = root_p / "replicate" / f"rank{rank}"

        def rebuild():
            if rank == 0:
                blob = (mine / "state.pt").read_bytes()
                dist.send(torch.tensor([len(blob)]), VICTIM)
                dist.send(torch.frombuffer(bytearray(blob), dtype=torch.uint8), VICTIM)
            if rank == VICTIM:
                size = torch.zeros(1, dtype=torch.int64)
                dist.recv(size, 0)
                buf = torch.empty(int(size), dtype=torch.uint8)
                dist.recv(buf, 0)
                mine.mkdir(parents=True, exist_ok=True)
                (mine / "state.pt").write_bytes(buf.numpy().tobytes())
                return int(size)  # counted once, on the receiving side
            return 0

        moved, t_rebuild = _timed(rebuild)
        _, t_load = _timed(lambda: torch.load(mine / "state.pt"))
        return dict(rebuild_bytes=moved, rebuild_s=t_rebuild, load_bytes=0, load_s=t_load)
    if method == "central":
        path = root_p / "central" / "state.pt"
        _, t_load = _timed(lambda: torch.load(path))
        return dict(rebuild_bytes=0, rebuild_s=0.0, load_bytes=path.stat().st_size, load_s=t_load)
    like = _state(mib)  # dcp loads into existing tensors (allocated, not yet touched)
    got = {"model": {k: torch.empty_like(v) for k, v in like["model"].items()}, "step": 0}
    del like
    _, t_load = _timed(lambda: dcp.load(got, storage_reader=dcp.FileSystemReader(str(root_p / "dcp"))))
    return dict(rebuild_bytes=0, rebuild_s=0.0, load_bytes=sum(v.nbytes for v in got["model"].values()),
                load_s=t_load)


def _worker(rank: int, n: int, init: str, root: str, mib: int, task: str, q) -> None:
    os.environ["OMP_NUM_THREADS"] = "1"
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init}", rank=rank, world_size=n,
                            timeout=timedelta(seconds=600))
    try:
        q.put((rank, _save_all(rank, root, mib) if task == "save" else _restore(rank, root, mib, task)))
    finally:
        dist.destroy_process_group()


def _group(n: int, tmp: str, mib: int, task: str) -> dict:
    """Run `task` on n fresh processes; results by rank."""
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    init = f"{tmp}/init_{task.replace(',', '').replace(' ', '_')}"
    procs = [ctx.Process(target=_worker, args=(r, n, init, tmp, mib, task, q)) for r in range(n)]
    for p in procs:
        p.start()
    res = dict(q.get(timeout=1800) for _ in range(n))
    for p in procs:
        p.join()
    return res


def run(n: int, mib: int) -> dict:
    with tempfile.TemporaryDirectory(prefix="rw_ckpt_dist_") as tmp:
        saved = _group(n, tmp, mib, "save")
        restored = {m: _group(n, tmp, mib, m) for m in METHODS}
    restored["replicate, fsync"] = restored["replicate"]
    table = {}
    table["async"] = {k: max(saved[r]["async"][k] for r in range(n)) for k in ("copy", "blocked", "total")}
    table["coded_phases"] = {k: max(restored["coded"][r]["phases"][k] for r in range(n)) for k in PHASES}
    for method in ("coded", "replicate", "replicate, fsync", "central", "dcp"):
        rows = [dict(saved[r][method], **restored[method][r]) for r in range(n)]
        table[method] = dict(save_s=max(x["save"] for x in rows), stored_bytes=sum(x["stored"] for x in rows),
                             rebuild_bytes=sum(x["rebuild_bytes"] for x in rows),
                             rebuild_s=max(x["rebuild_s"] for x in rows),
                             load_bytes=sum(x["load_bytes"] for x in rows),
                             load_s=max(x["load_s"] for x in rows))
    return dict(n=n, mib=mib, state_bytes=saved[0]["state_bytes"], methods=table)


def _part_timer():
    """(timed, rows): ``timed(name, fn)`` runs fn, appends (name, seconds) to rows, returns fn's result."""
    rows: list[tuple[str, float]] = []

    def timed(name, fn):
        t0 = time.perf_counter()
        out = fn()
        rows.append((name, time.perf_counter() - t0))
        return out

    return timed, rows


def _print_parts(title: str, rows: list[tuple[str, float]]) -> None:
    print(title + "\n")
    print("| part | seconds |\n|---|---|")
    for name, t in rows:
        print(f"| {name} | {t:.2f} |")


def profile_save(mib: int, n: int) -> None:
    """One rank's coded save, timed part by part in this process (no process group)."""
    import blake3
    import torch

    from rankwise import _io
    from rankwise.ckpt import Code2D
    from rankwise.ckpt._serial import _Sink

    torch.set_num_threads(1)
    state = _state(mib)
    code = Code2D(n, 1)
    timed, rows = _part_timer()
    # the checkpointer's steady state: its serialisation and line buffers exist from the last save
    sink, obj = _Sink(), {"state": state, "per_rank": None}
    sink.dump(obj)
    blob = timed("torch.save to memory (into the kept buffer)", lambda: sink.dump(obj))
    timed("state digest (blake3)", lambda: blake3.blake3(blob).digest())
    out = code.share_buffer(len(blob))
    code.encode_share(blob, 0, out=out)
    timed("encode_share (systematic rank 0)", lambda: code.encode_share(blob, 0, out=out))
    frag = timed(f"encode_share (parity rank {n - 1})", lambda: code.encode_share(blob, n - 1, out=out))[0]
    sealed = timed("the fragment file's parts (header checksum only)", frag.to_parts)
    with tempfile.TemporaryDirectory() as tmp:
        timed("atomic write with fsync", lambda: _io.write_atomic(Path(tmp) / "f", sealed))
    _print_parts(f"one rank's coded save of {mib} MiB (n = {n}), one process:", rows)


def profile_restore(mib: int, n: int) -> None:
    """One rank's share of a coded restore, timed part by part in this process: what every
    rank computes besides moving the rows (the transport: ``--transport``)."""
    import numpy as np
    import torch

    from rankwise.ckpt import Code2D
    from rankwise.ckpt._serial import _load_rows, _Rows, serialize
    from rankwise.ckpt._store import read_fragment, write

    torch.set_num_threads(1)
    code = Code2D(n, 1)
    blob = serialize({"state": _state(mib), "per_rank": None})
    disp = code.encode(blob)
    com, k = disp.commitment, code.k
    rows = _Rows(n, k * com.block_size)
    for i in range(k):  # as received
        rows.array[i] = np.frombuffer(disp.fragments[i].row, np.uint8)
    del disp
    timed, times = _part_timer()

    with tempfile.TemporaryDirectory() as tmp:
        write(Path(tmp) / "f", code.encode_share(blob, 0)[0])
        frag = timed("read the fragment file", lambda: read_fragment(Path(tmp) / "f"))
        timed("verify it (both lines, Merkle)", lambda: code.verified_lines(frag, com))
    timed(f"verify the other {k - 1} received rows",
          lambda: [code.verify_row(i, rows.array[i], com) for i in range(1, k)])
    where = "a memfd, torch.load(mmap=True)" if rows.fd is not None else "memory"
    timed(f"load the state from the rows ({where})",
          lambda: _load_rows(rows, list(range(k)), com.data_len, code, True))
    _print_parts(f"one rank's coded restore of {mib} MiB (n = {n}), one process, besides moving the rows:",
                 times)


def _transport(rank: int, n: int, init: str, mib: int, q) -> None:
    import torch
    import torch.distributed as dist

    from rankwise.ckpt import _wire

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init}", rank=rank, world_size=n)
    k = n - 1
    size = mib * 2**20 // k
    out = {}
    for _ in range(2):
        rows = [torch.empty(size, dtype=torch.uint8) for _ in range(n)]
        dist.barrier()
        t0 = time.perf_counter()
        dist.all_gather(rows, torch.full((size,), rank, dtype=torch.uint8))
        dist.barrier()
        out.setdefault("all-gather of n rows", []).append(time.perf_counter() - t0)
        buf = torch.empty((n, size), dtype=torch.uint8)
        if rank < k:
            buf[rank] = rank
        dist.barrier()
        t0 = time.perf_counter()
        for i in range(k):
            dist.broadcast(buf[i], i)
        dist.barrier()
        out.setdefault("k broadcasts into one buffer", []).append(time.perf_counter() - t0)
        dist.barrier()
        t0 = time.perf_counter()  # what the restore does: each holder sends its row to each rank itself
        received, sending = _wire.exchange({p: buf[rank] for p in range(n) if p != rank} if rank < k else {},
                                           {i: buf[i] for i in range(k) if i != rank}, dist.group.WORLD)
        for work in (*received.values(), *sending):
            work.wait()
        dist.barrier()
        out.setdefault("k rows sent directly into one buffer", []).append(time.perf_counter() - t0)
    q.put((rank, out))
    dist.destroy_process_group()


def transport(mib: int, n: int) -> None:
    """How the k rows of a restore travel: an all-gather of all n rows, k broadcasts of the
    systematic rows into one buffer (both relayed through other ranks by gloo), and the
    restore's way, each of the k holders sending its row to every rank directly (gloo, n
    processes)."""
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    with tempfile.TemporaryDirectory(prefix="rw_ckpt_tr_") as tmp:
        procs = [ctx.Process(target=_transport, args=(r, n, f"{tmp}/init", mib, q)) for r in range(n)]
        for p in procs:
            p.start()
        res = dict(q.get(timeout=600) for _ in range(n))
        for p in procs:
            p.join()
    print(f"moving the rows of a {mib} MiB state to every rank, n = {n} processes (gloo, one machine):\n")
    print("| transport | first call (s) | second call (s) |\n|---|---|---|")
    for name in res[0]:
        first, second = (max(res[r][name][i] for r in range(n)) for i in (0, 1))
        print(f"| {name} | {first:.2f} | {second:.2f} |")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--profile-save", action="store_true", help="only time one rank's save, part by part")
    ap.add_argument("--profile-restore", action="store_true",
                    help="only time one rank's restore after the rows arrived, part by part")
    ap.add_argument("--transport", action="store_true",
                    help="only time moving the rows: all-gather vs broadcasts vs direct sends")
    ap.add_argument("--nproc", type=int, default=4)
    ap.add_argument("--sizes", default="16,256", help="state sizes in MiB")
    ap.add_argument("--json", default=None, help="also write the results here")
    a = ap.parse_args()
    mib = int(a.sizes.split(",")[-1])
    if a.profile_save or a.profile_restore or a.transport:
        for flag, fn in ((a.profile_save, profile_save), (a.profile_restore, profile_restore),
                         (a.transport, transport)):
            if flag:
                fn(mib, a.nproc)
                print()
        return
    results = [run(a.nproc, int(s)) for s in a.sizes.split(",")]
    print(f"n = {a.nproc} processes (gloo, one machine), lost node: rank 2; bytes are totals over ranks\n")
    print("| size | method | save (s) | stored | rebuild lost node: bytes / s "
          "| load on every rank: bytes / s |")
    print("|---|---|---|---|---|---|")
    for r in results:
        m = r["state_bytes"]
        for name, x in r["methods"].items():
            if name in ("async", "coded_phases"):
                continue
            print(f"| {r['mib']} MiB | {name} | {x['save_s']:.2f} | {x['stored_bytes'] / m:.2f}·|m| | "
                  f"{x['rebuild_bytes'] / m:.2f}·|m| / {x['rebuild_s']:.2f} | "
                  f"{x['load_bytes'] / m:.2f}·|m| / {x['load_s']:.2f} |")
    print("\n| size | copy to host memory (s) | coded save, blocking=False: training blocked (s) "
          "| blocked / copy | the background save in all (s) |")
    print("|---|---|---|---|---|")
    for r in results:
        x = r["methods"]["async"]
        print(f"| {r['mib']} MiB | {x['copy']:.3f} | {x['blocked']:.3f} | {x['blocked'] / x['copy']:.2f} | "
              f"{x['total']:.2f} |")
    print("\n| size | coded restore, slowest rank per phase (s): " + " | ".join(PHASES) + " |")
    print("|---|" + "---|" * len(PHASES))
    for r in results:
        x = r["methods"]["coded_phases"]
        print(f"| {r['mib']} MiB | " + " | ".join(f"{x[k]:.2f}" for k in PHASES) + " |")
    if a.json:
        Path(a.json).write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
