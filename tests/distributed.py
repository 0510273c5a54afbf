"""Run a function on n gloo ranks in spawned processes, with a hard timeout."""

from __future__ import annotations

import multiprocessing as mp
import os
import time
import traceback
import uuid
from datetime import timedelta
from pathlib import Path


def _worker(rank: int, n: int, init_file: str, fn, args, queue, pg_timeout: float = 60.0) -> None:
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    try:
        dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=n,
                                timeout=timedelta(seconds=pg_timeout))
        out = fn(rank, *args)
        queue.put((rank, "ok", out))
    except BaseException:
        queue.put((rank, "error", traceback.format_exc()))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def run_world(fn, n: int, tmp: Path, *args, timeout: float = 120.0, pg_timeout: float = 60.0,
              exit_timeout: float = 60.0) -> list:
    """``fn(rank, *args)`` on ranks 0..n−1 (``fn`` must be importable: a module-level function)
    in a gloo group whose collectives time out after `pg_timeout` s; returns the results by
    rank, or raises with every failing rank's traceback (all within `timeout` s).

    Every call rendezvouses through a file of its own: torch's ``file://`` init needs a fresh
    file, and a world whose ranks did not tear down their store (killed, or exited early)
    leaves its keys in the file, so a later world reusing the name connects to dead peers and
    fails. A rank still alive `exit_timeout` s after all results arrived is killed and
    reported: a teardown that hangs (a background save that never ends) is a defect, not noise.
    """
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    init = str(Path(tmp) / f"pg_init_{uuid.uuid4().hex}")
    procs = [ctx.Process(target=_worker, args=(r, n, init, fn, args, queue, pg_timeout)) for r in range(n)]
    for p in procs:
        p.start()
    results: dict[int, tuple] = {}
    hung: list[int] = []
    try:
        for _ in range(n):
            r, status, out = queue.get(timeout=timeout)
            results[r] = (status, out)
    finally:
        deadline = time.monotonic() + (exit_timeout if len(results) == n else 10.0)
        for r, p in enumerate(procs):
            p.join(timeout=max(0.0, deadline - time.monotonic()))
            if p.is_alive():
                hung.append(r)
                p.kill()
                p.join()
    errors = {r: out for r, (s, out) in results.items() if s != "ok"}
    if errors:
        raise AssertionError("ranks failed:\n" + "\n".join(f"--- rank {r}\n{e}" for r, e in errors.items()))
    if hung:
        raise AssertionError(f"rank(s) {hung} returned but did not exit within {exit_timeout} s")
    return [results[r][1] for r in range(n)]


def fresh_side_group(seconds: float) -> None:
    """Collective, inside a world: give the coded checkpoint a side group of its own whose
    collectives time out after `seconds` (test plumbing: a scenario that leaves a rank waiting
    fails in seconds and does not hold up the next one)."""
    import weakref

    import torch.distributed as dist

    from rankwise.ckpt import _dcp

    dist.barrier()
    side = dist.new_group(backend="gloo", timeout=timedelta(seconds=seconds))
    _dcp._SIDE[:] = [(weakref.ref(dist.group.WORLD), weakref.ref(side))]
